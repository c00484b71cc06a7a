"""What the Mosaic GPU kernels share: the module, imported where a kernel is built (some jax builds lack it), what
this jax can do with it, a load with a layout that runs on both jax versions the project supports, and the
operations that differ between the compiled kernel and Mosaic GPU's interpreter (`kernel_ops`)."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def mosaic_gpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def mosaic_lowering_available() -> bool:
    """Pallas' Mosaic GPU backend with warp-specialized pipelines, which lowers the kernels for a GPU from any
    machine (`jax.export`): jax 0.10 has it too."""
    try:
        plgpu = mosaic_gpu()
    except ImportError:
        return False
    return hasattr(plgpu, "emit_pipeline_warp_specialized")


def mosaic_kernels_available() -> bool:
    """The Mosaic GPU kernels run compiled (jax >= 0.11, where they were verified on the H200). jax 0.10 lowers
    them, and its interpreter runs them through `InterpretedOps` (it has no rule for `plgpu.load`, layouts or
    `run_state`, nor for the cluster barrier)."""
    return mosaic_lowering_available() and hasattr(mosaic_gpu(), "InterpretGPUParams")


def interpret_params(**options):
    """Mosaic GPU's interpreter's parameters (`InterpretGPUParams`: `detect_races`, `uninitialized_memory`, ...),
    which jax 0.11 exports from `plgpu` and jax 0.10 keeps in its private modules."""
    plgpu = mosaic_gpu()
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams(**options)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**options)


def interpret_option(interpret) -> dict:
    """`plgpu.kernel`'s keyword for a kernel's `interpret` argument: nothing (compiled), or the interpreter's
    parameters (True: the defaults; or an `InterpretGPUParams`, e.g. with `detect_races=True`)."""
    if not interpret:
        return {}
    return {"interpret": interpret_params() if interpret is True else interpret}


@functools.cache
def _load_takes_an_index() -> bool:
    return inspect.signature(mosaic_gpu().load).parameters["idx"].default is inspect.Parameter.empty


def load_with_layout(ref, layout):
    """`plgpu.load(ref, layout=layout)` of the whole ref: jax 0.10 requires the index argument, which jax 0.11
    deprecates (the ref is indexed with `.at[...]` instead)."""
    plgpu = mosaic_gpu()
    return plgpu.load(ref, (), layout=layout) if _load_takes_an_index() else plgpu.load(ref, layout=layout)


class CompiledOps:
    """The operations of the Mosaic GPU kernels that Mosaic GPU's interpreter lacks (register layouts, `plgpu.load`,
    wgmma with a transposed operand, `run_state`), as compiled for the GPU; `InterpretedOps` has the same on any
    machine. A kernel that takes its operations from `kernel_ops(interpret)` runs the rest of its body (warpgroups,
    barriers, TMA copies, shared memory) the same way compiled and interpreted."""

    def __init__(self):
        self.plgpu = mosaic_gpu()

    def with_layout(self, array, layout):
        return self.plgpu.layout_cast(array, layout)

    def load(self, ref, layout):
        return load_with_layout(ref, layout)

    def matmul_transposed(self, a_ref, b_ref):
        """a_ref @ b_ref.T in float32 on the tensor cores (wgmma), both operands in shared memory; returns when the
        tensor cores are done reading them."""
        return self.matmul_transposed_sum([(lambda: None, a_ref, b_ref)])

    def matmul_transposed_sum(self, parts):
        """The sum of a_ref @ b_ref.T over `parts` [(before, a_ref, b_ref)], each issued to the tensor cores once
        `before()` returns (a barrier wait: its operands have landed) and without waiting for the previous ones;
        returns when the tensor cores are done reading them all."""
        plgpu = self.plgpu

        def product(acc_ref):
            for before, a_ref, b_ref in parts:
                before()
                plgpu.wgmma(acc_ref, a_ref, b_ref.transpose((1, 0)))
            return acc_ref[...]  # reading the accumulator waits for the wgmmas

        _, a_ref, b_ref = parts[0]
        return pl.run_scoped(product, plgpu.ACC((a_ref.shape[0], b_ref.shape[0]), jnp.float32))

    def accumulate_sum(self, acc, parts):
        """acc + the sum of a_ref @ b_ref over `parts` [(before, a_ref, b_ref, after)]: each issued once `before()`
        returns, without waiting for the previous ones, and `after()` called once it is done. Both operands in shared
        memory: a register operand must stay untouched until its wgmma is done, which ptxas may enforce by
        serialising the wgmmas."""
        plgpu = self.plgpu

        def body(acc_ref):
            for before, a_ref, b_ref, _ in parts:
                before()
                plgpu.wgmma(acc_ref, a_ref, b_ref)
            for done, (*_, after) in enumerate(parts, 1):
                plgpu.wgmma_wait(len(parts) - done)
                after()

        return pl.run_state(body)(plgpu.ACC.init(acc))

    def accumulate_then_matmul_transposed(self, acc, product, parts):
        """(acc + a_ref @ b_ref, the sum of c_ref @ d_ref.T over `parts`), for a product (before, a_ref, b_ref,
        after) and parts [(before, c_ref, d_ref)], all in shared memory: the product goes to the tensor cores first,
        then each part once its `before()` returns, none waiting for the ones before; the product's `after()` is
        called once it is done, with the first part in flight. The next block's S behind this block's last P V:
        the tensor cores do not drain between them. Returns when all are done."""
        plgpu = self.plgpu
        before, a_ref, b_ref, after = product
        _, c_ref, d_ref = parts[0]

        def body(refs):
            acc_ref, sum_ref = refs
            before()
            plgpu.wgmma(acc_ref, a_ref, b_ref)
            for index, (part_before, part_a, part_b) in enumerate(parts):
                part_before()
                plgpu.wgmma(sum_ref, part_a, part_b.transpose((1, 0)))
                if index == 0:
                    plgpu.wgmma_wait(1)  # the product's group, issued first, is done
                    after()

        zeros = self.with_layout(jnp.zeros((c_ref.shape[0], d_ref.shape[0]), jnp.float32), plgpu.Layout.WGMMA)
        return pl.run_state(body)((plgpu.ACC.init(acc), plgpu.ACC.init(zeros)))

    def accumulate(self, acc, a, b_ref):
        """acc + a @ b_ref (wgmma), `a` in registers or shared memory; returns when the tensor cores are done reading
        them."""
        return pl.run_state(lambda acc_ref: self.plgpu.wgmma(acc_ref, a, b_ref))(self.plgpu.ACC.init(acc))


class InterpretedOps:
    """`CompiledOps` in Mosaic GPU's interpreter: loads and dots of whole refs, which its race detector tracks (it
    does not track wgmma's reads). The products are exact in float32 and summed in float32, as on the tensor
    cores, in another order."""

    def with_layout(self, array, layout):
        return array

    def load(self, ref, layout):
        return ref[...]

    def matmul_transposed(self, a_ref, b_ref):
        return lax.dot_general(a_ref[...].astype(jnp.float32), b_ref[...].astype(jnp.float32),
                               (((1,), (1,)), ((), ())))

    def matmul_transposed_sum(self, parts):
        total = 0.0
        for before, a_ref, b_ref in parts:
            before()
            total = total + self.matmul_transposed(a_ref, b_ref)
        return total

    def accumulate_sum(self, acc, parts):
        for before, a_ref, b_ref, after in parts:
            before()
            acc = self.accumulate(acc, a_ref, b_ref)
            after()
        return acc

    def accumulate_then_matmul_transposed(self, acc, product, parts):
        before, a_ref, b_ref, after = product
        before()
        acc = self.accumulate(acc, a_ref, b_ref)
        total = 0.0
        for index, (part_before, part_a, part_b) in enumerate(parts):
            part_before()
            total = total + self.matmul_transposed(part_a, part_b)
            if index == 0:
                after()
        return acc, total

    def accumulate(self, acc, a, b_ref):
        a = a if isinstance(a, jax.Array) else a[...]
        return acc + jnp.dot(a.astype(jnp.float32), b_ref[...].astype(jnp.float32))


def kernel_ops(interpret):
    return InterpretedOps() if interpret else CompiledOps()
