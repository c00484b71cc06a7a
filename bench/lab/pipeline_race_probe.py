"""Does this jax's Mosaic GPU interpreter report races in its own warp-specialized pipeline? A bare
`plgpu.emit_pipeline_warp_specialized` (a TMA producer, two consumers reading their half of each step's tile with
plain loads), run in the interpreter with the race detector on.

    python bench/lab/pipeline_race_probe.py --steps 4           # slots refilled: jax 0.11.2 reports races, 0.10.2 none
    python bench/lab/pipeline_race_probe.py --steps 2           # no slot refilled: none on either
    python bench/lab/pipeline_race_probe.py --steps 4 --fence   # a proxy fence after the reads: none on either

Measured on 2026-12-05 (CPU): the rows above, as commented. jax 0.11's detector keeps the generic and the async
proxy's clocks apart, so a plain load of a slot followed by the TMA refilling it is a race unless a proxy fence
(`plgpu.commit_smem`) orders them. `pallas_kernels.fp8_matmul_mosaic.FENCE_STEP_READS` is that fence in the FP8 GEMM.
"""

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="K steps, two slots (default 4: each slot refilled)")
    parser.add_argument("--fence", action="store_true", help="commit_smem at the end of each consumer's step")
    args = parser.parse_args()

    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels._mosaic import interpret_params

    rows, width = 128, 128

    def kernel(x_gmem, out_gmem):
        half = pl.ds(lax.axis_index("wg") * (rows // 2), rows // 2)

        def step(indices, x_smem, total):
            total = total + x_smem[half, :]
            if args.fence:
                plgpu.commit_smem()
            return total

        def context(run):
            out_gmem[half, :] = run(jnp.zeros((rows // 2, width), jnp.float32))

        plgpu.emit_pipeline_warp_specialized(
            step, grid=(args.steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=2,
            compute_context=context,
            in_specs=[plgpu.BlockSpec((rows, width), lambda k: (0, k), memory_space=plgpu.SMEM)])(x_gmem)

    x = jax.random.normal(jax.random.key(0), (rows, width * args.steps), jnp.float32)
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((rows, width), jnp.float32), num_threads=3,
                        thread_name="wg",
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        interpret=interpret_params(detect_races=True))
    gpu_callbacks.reset_gpu_interpret_mode_state()
    out = call(x).block_until_ready()
    error = float(jnp.abs(out - x.reshape(rows, args.steps, width).sum(1)).max())
    print(f"jax {jax.__version__}, {args.steps} steps, fence {args.fence}: "
          f"races {gpu_callbacks.get_races().races_found}, largest error {error}")


if __name__ == "__main__":
    main()
