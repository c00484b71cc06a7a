"""FP8 GEMMs for checkpoints served in FP8: float8_e4m3fn weights in the checkpoint's [N, K] layout with their float32
scales, activations quantized to e4m3 on the fly.

Two weight formats:
  * block-scaled (DeepSeek-V3.2, GLM-5; `block` = (128, 128)): one scale per block of the weight, w ≈ w8 · s
    (checkpoints call it `weight_scale_inv`, but it multiplies). Edge blocks may be partial (DeepSeek's 576-row
    kv_a_proj_with_mqa has 5 row blocks). Activations are quantized dynamically, one scale per token and per
    `block[1]` channels (the weight's column block): scale = amax / 448, amax floored at 1e-4 so that an all-zero
    group keeps a finite scale, and with `pow2_scales` rounded up to a power of two (config `scale_fmt: ue8m0`).
    This is `act_quant` of DeepSeek's reference inference code.
  * per-tensor (NVIDIA ModelOpt FP8; `block=None`): one `weight_scale` per weight and a static, calibrated
    `input_scale` per layer: x8 = e4m3(clip(x / input_scale, ±448)). (jnp's cast to e4m3 gives NaN past ±448 where
    torch saturates, hence the explicit clip.)
Divisions are written as products with float32 reciprocals, amax · (1/448) and x · (1/scale): XLA rewrites a
division by a broadcast value so anyway, and spelled out it is the same on every backend and in the tests' torch and
numpy oracles. It can differ from a true quotient in the last bit, which moves an e4m3 rounding once in ~10^6 values.

`fp8_matmul(x[M, K], w[N, K], w_scale, ...) -> [M, N]` and, for MoE experts over rows sorted by expert as in
`grouped_matmul`, `fp8_grouped_matmul(x[M, K], w[E, N, K], w_scale[E, ...], group_sizes[E], ...) -> [M, N]`; rows past
sum(group_sizes) come out as zeros. Scales: block-scaled [⌈N/bn⌉, ⌈K/bk⌉] (per expert for the grouped form);
per-tensor a scalar (one per expert). Output dtype = x's.

The XLA reference (`impl="xla"`) quantizes the activations as above, dequantizes both operands to float32 and takes
one float32 dot at HIGHEST precision: the products and scales an FP8 tensor-core GEMM with float32 accumulation
applies, summed in another order. It is the oracle the GPU paths are tested against.

GPU paths (what `impl="auto"` takes on a GPU with FP8 tensor cores, compute capability 8.9 or newer; see
GPU_PATHS_VERIFIED; below 8.9, Ampere and older, `auto` runs the reference, which dequantizes the weights in the step):
  * block-scaled: activations quantized in XLA (memory-bound, fused), then the Pallas kernels of
    `fp8_matmul_pallas` (`impl="pallas"`), which scale each 128-wide K block's e4m3 product as it accumulates.
    A scale block whose width is no power of two >= 16 (no published checkpoint has one) falls back to the reference.
  * per-tensor dense: `impl="xla_fp8"`, the quantized activations and the weight in one `lax.dot_general` of two
    e4m3 operands contracting K of both (cuBLASLt's FP8 GEMM in its "TN" layout, no transpose), float32 out, times
    input_scale · weight_scale. `impl="pallas"` runs the block kernel with the scales broadcast per block instead.
  * per-tensor grouped: the block kernel with each expert's scales broadcast per block (`ragged_dot` takes e4m3
    operands but is no fast path on the GPU).
  * block-scaled (128, 128) with N and K multiples of 128, on a Hopper, where jax has Pallas' Mosaic GPU backend
    (jax >= 0.11):
    `fp8_matmul_mosaic` (`impl="mosaic"`), a warp-specialized wgmma kernel, dense (from MOSAIC_MIN_ROWS rows) and
    grouped, rows padded to its 128-row tile; see BLOCK_KERNEL.
  * block-scaled (128, 128), dense, from CUBLASLT_MIN_ROWS rows (prefill), one Hopper: cuBLASLt's own block-scaled
    FP8 GEMM (`fp8_matmul_cublaslt`, `impl="cublaslt"`), called from the step through a `buffer_callback`.
On CPU `auto` runs the reference, and `interpret=True` runs the Pallas kernels in interpret mode (as the tests do).
"""

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from . import _dispatch
from ._dispatch import is_hopper, lacks_fp8_tensor_cores, log, on_gpu, resolve_impl
from ._mosaic import mosaic_kernels_available
from .fp8_matmul_pallas import fp8_block_grouped_matmul, fp8_block_matmul, pallas_problem
from .packing import count_at_or_below, prefix_sum

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant clamps a group's amax here
IMPLS = ("auto", "pallas", "xla", "xla_fp8", "mosaic", "cublaslt")  # xla_fp8: per-tensor only; mosaic, cublaslt: block
# (128, 128) only
# Whether `auto` takes the GPU paths on a GPU: yes. On the H200 they passed `bench/fp8_kernels.py --check` (block
# kernels 1e-6..4e-6 of the largest output, the Mosaic ones 1.4e-4..2.6e-4 and the per-tensor cuBLASLt dot 0..1.3e-4,
# within the FP8 tensor cores' accumulation), the compiled-kernel tests, the engine (`bash bench/lab/h200_runs.sh
# fp8_engine`) and, on 2026-12-01 09:02 UTC, every FP8 model test with them taken (`bash bench/lab/h200_runs.sh
# fp8_models`: 64 passed). JAXMODELS_FP8_GPU_PATHS=0 makes `auto` run the reference (dequantize, then a float32 dot)
# on the GPU instead, for comparison.
GPU_PATHS_VERIFIED = os.environ.get("JAXMODELS_FP8_GPU_PATHS", "1") != "0"


# Which kernel `auto` runs block-scaled (128, 128) weights on (N and K multiples of 128) when it takes the GPU paths:
# "mosaic" (`fp8_matmul_mosaic`) where jax has it, else "pallas" (Triton); JAXMODELS_FP8_BLOCK_KERNEL picks one.
# On the H200 (2026-12-01, `bash bench/lab/h200_runs.sh fp8`, bf16 alongside): dense M=4096 K=7168 N=18432 Mosaic
# 1.073 ms, Triton 2.99 ms, bf16 1.578; the MoE grouped matmul Mosaic x1.34-1.62 of bf16, Triton x0.23-1.06. Dense
# rows below MOSAIC_MIN_ROWS stay on Triton: at 16 rows it takes 44 us, Mosaic (rows padded to its 128-row tile,
# 144 column tiles on 132 SMs) 68 us.
BLOCK_KERNEL = os.environ.get("JAXMODELS_FP8_BLOCK_KERNEL") or ("mosaic" if mosaic_kernels_available() else "pallas")
MOSAIC_MIN_ROWS = 65
# Dense block-scaled products of at least this many rows run on cuBLASLt's block-scaled GEMM (`fp8_matmul_cublaslt`)
# where `auto` takes the GPU paths on a one-device process (`_one_device`); JAXMODELS_FP8_CUBLASLT=0 keeps them on
# BLOCK_KERNEL. On the H200 (2026-12-01, `FP8_ONLY=cublaslt bash bench/lab/h200_runs.sh fp8`) at M=4096 K=7168 N=18432:
# 0.960 ms (x1.64 of bf16's 1.577, the Mosaic kernel 1.087 in the same run). With the activations' quantization in
# front, the library was ahead of the Mosaic kernel from 128 rows up (seventh run, docs/BENCHMARKS.md: 0.065 against
# 0.077 ms at 128 rows, 0.152 against 0.165 at 512), but the GEMM alone timed slower at 128 rows and below (0.103 ms),
# which is not understood, and no engine run has measured decode batches on the callback: rows below 1024 stay on the
# kernels. (End to end, the DeepSeek 4k prefill took 78.8 ms with it and 77.5 without: within the runs' spread.)
# JAXMODELS_FP8_CUBLASLT_MIN_ROWS moves the line, to measure decode batches on the library through the engine
# (`bash bench/lab/h200_runs.sh fp8_engine_rows`).
CUBLASLT_MIN_ROWS = int(os.environ.get("JAXMODELS_FP8_CUBLASLT_MIN_ROWS", "1024"))
USE_CUBLASLT = os.environ.get("JAXMODELS_FP8_CUBLASLT", "1") != "0"
# The per-tensor format on the block kernels: its scales broadcast over blocks of this size (the K step).
PER_TENSOR_BLOCK = (128, 128)


def _repeat_to(scale: jax.Array, block: int, size: int, axis: int) -> jax.Array:
    """Block scales along `axis` expanded to one per element: [.., ⌈size/block⌉, ..] -> [.., size, ..]."""
    return lax.slice_in_dim(jnp.repeat(scale, block, axis=axis), 0, size, axis=axis)


def _per_element(scale: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """Block scales [..., ⌈N/bn⌉, ⌈K/bk⌉] expanded to one per element of a [..., N, K] weight."""
    return _repeat_to(_repeat_to(scale, block[0], shape[0], axis=-2), block[1], shape[1], axis=-1)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _pow2_at_or_above(x: jax.Array) -> jax.Array:
    """The smallest power of two >= x > 0, exactly (exp2 and log2 are not exact on every backend)."""
    mantissa, exponent = jnp.frexp(x)  # x = mantissa · 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(x), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def _to_e4m3(x: jax.Array, scale: jax.Array) -> jax.Array:
    """e4m3(clip(x · (1 / scale), ±448)): x · (1/scale) may round a hair past 448, which the cast would turn into
    NaN.

    The optimization barrier keeps the e4m3 rounding: XLA's GPU compiler, with its default
    `xla_allow_excess_precision`, removes a float32 -> narrower float -> float32 convert pair as if it were exact
    (SimplifyFPConversions), which would let the reference multiply unquantized activations. (On the H200 the
    reference differed from the FP8 dots, XLA's cuBLASLt one and the Pallas kernel alike, by 1e-3 to 3e-2 of the
    largest output, the size of e4m3 rounding of the activations, while the CPU agreed to float32 rounding.)"""
    return lax.optimization_barrier(jnp.clip(x * jnp.reciprocal(scale), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE))


def quantize_activations(x: jax.Array, group: int, *, pow2_scales: bool = False):
    """x[..., K] -> (float8_e4m3fn x8[..., K], float32 scales[..., ⌈K/group⌉]) with x ≈ x8 · scale, one scale per
    `group` consecutive channels of each row (a partial last group has its own)."""
    xf = x.astype(jnp.float32)
    k = x.shape[-1]
    groups = _blocks(k, group)
    padded = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, groups * group - k)])  # zeros leave every amax as it is
    grouped = padded.reshape(*x.shape[:-1], groups, group)
    scale = jnp.maximum(jnp.abs(grouped).max(-1), AMAX_FLOOR) * jnp.float32(1 / FP8_MAX)
    if pow2_scales:
        scale = _pow2_at_or_above(scale)
    x8 = _to_e4m3(grouped, scale[..., None])
    return x8.reshape(*x.shape[:-1], groups * group)[..., :k], scale


def dequantize_activations(x8: jax.Array, scale: jax.Array, group: int) -> jax.Array:
    """The float32 values `quantize_activations` stands for."""
    return x8.astype(jnp.float32) * _repeat_to(scale, group, x8.shape[-1], axis=-1)


def quantize_static(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """x in e4m3 with a static per-tensor scale (broadcastable to x): e4m3(clip(x / s, ±448))."""
    return _to_e4m3(x.astype(jnp.float32), input_scale)


def quantize_weight(w: jax.Array, block: tuple[int, int] | None):
    """Dense w[..., N, K] -> (float8_e4m3fn w8, float32 scales) with w ≈ w8 · scale in `dequantize_weight`'s layout:
    one scale = amax / 448 per block (1 for an all-zero block), or per trailing [N, K] matrix with `block` None. How
    the published checkpoints were quantized; here it makes FP8 weights from dense ones (benchmarks, tests)."""
    wf = w.astype(jnp.float32)
    n, k = w.shape[-2:]
    bn, bk = block or (n, k)
    rows, cols = _blocks(n, bn), _blocks(k, bk)
    padded = jnp.pad(wf, [(0, 0)] * (w.ndim - 2) + [(0, rows * bn - n), (0, cols * bk - k)])
    amax = jnp.abs(padded.reshape(*w.shape[:-2], rows, bn, cols, bk)).max((-3, -1))
    scale = jnp.where(amax > 0, amax * jnp.float32(1 / FP8_MAX), 1.0)
    w8 = _to_e4m3(wf, _per_element(scale, (bn, bk), (n, k)))
    return w8, (scale if block else scale[..., 0, 0])


def dequantize_weight(w: jax.Array, w_scale: jax.Array, block: tuple[int, int] | None) -> jax.Array:
    """float32 weights from FP8 w[..., N, K] and their scales: block-scaled [..., ⌈N/bn⌉, ⌈K/bk⌉] (`block` = (bn, bk)),
    or per-tensor (`block` None) with one scale per leading index ([] for one weight, [E] for a stack)."""
    wf = w.astype(jnp.float32)
    if block is None:
        return wf * jnp.reshape(w_scale, w_scale.shape + (1, 1))
    return wf * _per_element(w_scale, block, w.shape[-2:])


def _dequantized_input(x, block, input_scale, pow2_scales):
    """float32 activations as the GEMM sees them: quantized per token and column block, or with the static scale
    (`input_scale` broadcastable to x's rows)."""
    if block is None:
        return quantize_static(x, input_scale).astype(jnp.float32) * input_scale
    x8, scale = quantize_activations(x, block[1], pow2_scales=pow2_scales)
    return dequantize_activations(x8, scale, block[1])


def _expert_of_row(group_sizes, rows: int) -> jax.Array:
    """int32[rows]: the expert each row of a grouped matmul belongs to, the last expert for rows past the total
    (their output is zero anyway). Loop-free (see packing), as it runs inside every engine step."""
    ends = prefix_sum(group_sizes.astype(jnp.int32))
    return jnp.minimum(count_at_or_below(ends, jnp.arange(rows, dtype=jnp.int32)), group_sizes.shape[0] - 1)


def _check_scales(w, w_scale, block, input_scale, stacked: int):
    """Scales that fit w: [⌈N/bn⌉, ⌈K/bk⌉] per weight with a block, one per weight (and an input scale) without."""
    lead = w.shape[:stacked]
    if block is None:
        expected = lead
        if input_scale is None or tuple(input_scale.shape) != expected:
            raise ValueError(f"per-tensor FP8 needs a static input_scale of shape {expected}, got "
                             f"{None if input_scale is None else tuple(input_scale.shape)}")
    else:
        n, k = w.shape[-2:]
        expected = lead + (_blocks(n, block[0]), _blocks(k, block[1]))
    if tuple(w_scale.shape) != expected:
        raise ValueError(f"weight {tuple(w.shape)} with block {block} needs scales of shape {expected}, got "
                         f"{tuple(w_scale.shape)}")


def _check_operands(x, w, impl, impls):
    if impl not in impls:
        raise ValueError(f"impl must be one of {impls}, got {impl!r}")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x has K={x.shape[-1]}, w {tuple(w.shape)} has K={w.shape[-1]}")


def _kernel_operands(x, w_scale, block, input_scale_of_row, pow2_scales, N):
    """(x8, x_scale[M, ⌈K/bk⌉], w_scale[..., ⌈N/bn⌉, ⌈K/bk⌉], block) in the block kernels' form. Per-tensor: x
    quantized with each row's static scale, both scales broadcast over PER_TENSOR_BLOCK blocks."""
    if block is not None:
        x8, x_scale = quantize_activations(x, block[1], pow2_scales=pow2_scales)
        return x8, x_scale, w_scale, block
    (M, K), (bn, bk) = x.shape, PER_TENSOR_BLOCK
    x8 = quantize_static(x, input_scale_of_row[:, None])
    x_scale = jnp.broadcast_to(input_scale_of_row[:, None], (M, _blocks(K, bk)))
    w_scale = jnp.broadcast_to(w_scale[..., None, None], w_scale.shape + (_blocks(N, bn), _blocks(K, bk)))
    return x8, x_scale, w_scale, PER_TENSOR_BLOCK


def fp8_matmul_reference(x, w, w_scale, *, block, input_scale=None, pow2_scales=False):
    xd = _dequantized_input(x, block, input_scale, pow2_scales)
    wd = dequantize_weight(w, w_scale, block)
    out = jnp.dot(xd, wd.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def fp8_dot_algorithm():
    """The algorithm of an XLA dot of e4m3 operands: on the GPU float32 accumulation asked for explicitly. Left to its
    default, cuBLASLt's FP8 GEMM was 1e-3..8e-3 of the largest output off the reference at K = 7168 on the H200
    (2026-12-01), against 1e-4 at K = 200: Hopper's FP8 MMA accumulates with fewer bits than float32 (about 14,
    DeepSeek-V3 report §3.3.2), and without promotion the error grows along K. The CPU takes no algorithm for FP8."""
    return lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32 if on_gpu() else None


def fp8_matmul_xla_fp8(x, w, w_scale, *, input_scale):
    """Per-tensor FP8 in one XLA dot of e4m3 operands (w[N, K] contracted on K as it is stored), float32 out.

    One row (a decode step at one sequence) is padded to two: XLA's GPU simplifier turns a vector-matrix dot into a
    multiply and a reduction, which knows no FP8 algorithm, and the compile fails ("Unsupported dot precision
    algorithm", H200, jax 0.11.2, 2026-12-01); cuBLASLt takes two rows."""
    rows = x.shape[0]
    x8 = quantize_static(x, input_scale)
    if rows == 1 and on_gpu():
        x8 = jnp.pad(x8, ((0, 1), (0, 0)))
    out = lax.dot_general(x8, w, (((1,), (1,)), ((), ())), precision=fp8_dot_algorithm(),
                          preferred_element_type=jnp.float32)
    return (out[:rows] * (input_scale * w_scale)).astype(x.dtype)


def _gpu_paths_or_reference(impl: str, interpret: bool) -> str:
    """`auto` -> "xla" (outside interpret mode) when the GPU paths are switched off (GPU_PATHS_VERIFIED) or the GPU
    has no FP8 tensor cores (`lacks_fp8_tensor_cores`): the reference then dequantizes the FP8 weights in the step
    (the checkpoint's bytes stay on the device) into a float32 dot."""
    if impl != "auto" or interpret:
        return impl
    if lacks_fp8_tensor_cores():
        _warn_no_fp8_tensor_cores()
        return "xla"
    return impl if GPU_PATHS_VERIFIED else "xla"


@functools.lru_cache(maxsize=None)
def _warn_no_fp8_tensor_cores() -> None:
    major, minor = _dispatch.gpu_capability()
    log.warning("this GPU (compute capability %d.%d) has no FP8 tensor cores: FP8 weights run through the reference, "
                "dequantized in every step into float32 dots; where memory allows, load with "
                "quantization='dequantize' for the compute dtype's speed", major, minor)


def _matmul_impl(impl: str, block, interpret: bool) -> str:
    """"xla", "xla_fp8", "pallas", "mosaic" or "cublaslt" for fp8_matmul: `auto` on the GPU takes cuBLASLt's FP8
    GEMM for per-tensor weights and the Pallas kernel for block-scaled ones (unless the kernel cannot take the block:
    the reference), which `fp8_matmul` may then hand to cuBLASLt's block-scaled GEMM (`_auto_takes_cublaslt`) or the
    Mosaic kernel (`_auto_takes_mosaic`)."""
    if impl in ("mosaic", "cublaslt"):
        _check_block_128(block, impl)
        if impl == "cublaslt" and not on_gpu():
            raise ValueError("impl='cublaslt' calls cuBLASLt and runs on NVIDIA GPUs only; use impl='auto' or 'xla'")
        return impl
    if impl == "xla_fp8":
        if block is not None:
            raise ValueError("impl='xla_fp8' is the per-tensor (block=None) form's; block-scaled FP8 runs 'pallas'")
        return impl
    impl = _gpu_paths_or_reference(impl, interpret)
    choice = resolve_impl(impl, interpret, block and pallas_problem(block), "fp8_matmul")
    return "xla_fp8" if impl == "auto" and choice == "pallas" and block is None and not interpret else choice


def fp8_matmul(x, w, w_scale, *, block: tuple[int, int] | None, input_scale=None, pow2_scales: bool = False,
               impl: str = "auto", interpret: bool = False, **kernel_options):
    """x[M, K] @ FP8 w[N, K]ᵀ -> [M, N]. See the module docstring; `kernel_options` go to the kernel that runs
    (the Triton one's: block_m, block_n, num_warps, num_stages, byte_pairs, split_k; the Mosaic one's: tile_m,
    steps_in_flight, group_items, ...)."""
    _check_operands(x, w, impl, IMPLS)
    _check_scales(w, w_scale, block, input_scale, stacked=0)
    which = _matmul_impl(impl, block, interpret)
    if _auto_takes_cublaslt(impl, which, block, w.shape, interpret) and x.shape[0] >= CUBLASLT_MIN_ROWS:
        which = "cublaslt"
    elif _auto_takes_mosaic(impl, which, block, w.shape, interpret) and x.shape[0] >= MOSAIC_MIN_ROWS:
        which = "mosaic"
    if which == "xla":
        return fp8_matmul_reference(x, w, w_scale, block=block, input_scale=input_scale, pow2_scales=pow2_scales)
    if which == "xla_fp8":
        return fp8_matmul_xla_fp8(x, w, w_scale, input_scale=input_scale)
    if which == "mosaic":
        return _mosaic_matmul(x, w, w_scale, pow2_scales, interpret, **kernel_options)
    if which == "cublaslt":
        return _cublaslt_matmul(x, w, w_scale, pow2_scales)
    row_scales = None if block else jnp.broadcast_to(input_scale, x.shape[:1])
    x8, x_scale, w_scale, kernel_block = _kernel_operands(x, w_scale, block, row_scales, pow2_scales, w.shape[0])
    return fp8_block_matmul(x8, x_scale, w, w_scale, block=kernel_block, out_dtype=x.dtype, interpret=interpret,
                            **kernel_options)


def _auto_takes_mosaic(impl: str, choice: str, block, w_shape, interpret: bool) -> bool:
    """Whether `auto`, having chosen the Pallas block kernel, runs the Mosaic one instead (BLOCK_KERNEL; a Hopper's
    wgmma kernel)."""
    return (impl == "auto" and choice == "pallas" and BLOCK_KERNEL == "mosaic" and not interpret and is_hopper()
            and tuple(block or ()) == (128, 128) and not w_shape[-1] % 128 and not w_shape[-2] % 128)


def _auto_takes_cublaslt(impl: str, choice: str, block, w_shape, interpret: bool) -> bool:
    """Whether `auto`, having chosen the Pallas block kernel, may run cuBLASLt's block-scaled GEMM instead (from
    CUBLASLT_MIN_ROWS rows, on a Hopper, where it was measured)."""
    from .fp8_matmul_cublaslt import cublaslt_problem

    return (impl == "auto" and choice == "pallas" and USE_CUBLASLT and not interpret and is_hopper() and _one_device()
            and cublaslt_problem(w_shape[-2], w_shape[-1], block) is None)


def _one_device() -> bool:
    """Whether the process has one device. The callback has no sharding rule, so under a mesh XLA would gather a
    sharded weight (and the activations) around it on every call: meshes keep the kernels until it has one."""
    return jax.device_count() == 1


def _check_block_128(block, impl: str) -> None:
    if tuple(block or ()) != (128, 128):
        raise ValueError(f"impl={impl!r} takes (128, 128) block-scaled weights, got block {block}")


def _cublaslt_matmul(x, w, w_scale, pow2_scales):
    from .fp8_matmul_cublaslt import fp8_block_matmul_cublaslt

    x8, x_scale = quantize_activations(x, 128, pow2_scales=pow2_scales)
    return fp8_block_matmul_cublaslt(x8, x_scale, w, w_scale, out_dtype=x.dtype)


def _mosaic_matmul(x, w, w_scale, pow2_scales, interpret, **kernel_options):
    """The Mosaic GPU kernel on rows padded to its row tile (2 x tile_m, times the cluster size)."""
    from .fp8_matmul_mosaic import fp8_block_matmul_mosaic, row_multiple

    rows = row_multiple(kernel_options.get("tile_m", 64), kernel_options.get("cluster", 1))
    M = x.shape[0]
    x8, x_scale = quantize_activations(x, 128, pow2_scales=pow2_scales)
    pad = -M % rows
    x8, x_scale = jnp.pad(x8, ((0, pad), (0, 0))), jnp.pad(x_scale, ((0, pad), (0, 0)))
    out = fp8_block_matmul_mosaic(x8, x_scale, w, w_scale, out_dtype=x.dtype, interpret=interpret, **kernel_options)
    return out[:M]


def fp8_grouped_matmul_reference(x, w, w_scale, group_sizes, *, block, input_scale=None, pow2_scales=False):
    sizes = group_sizes.astype(jnp.int32)
    if block is None:  # each row is quantized with its expert's input scale
        input_scale = input_scale[_expert_of_row(sizes, x.shape[0])][:, None]
    xd = _dequantized_input(x, block, input_scale, pow2_scales)
    wd = dequantize_weight(w, w_scale, block)
    out = lax.ragged_dot(xd, wd.transpose(0, 2, 1), sizes, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def fp8_grouped_matmul(x, w, w_scale, group_sizes, *, block: tuple[int, int] | None, input_scale=None,
                       pow2_scales: bool = False, impl: str = "auto", interpret: bool = False, **kernel_options):
    """Rows x[M, K] sorted by expert, expert g taking group_sizes[g] rows, each times its expert's FP8 w[g]ᵀ (w[E, N,
    K]) -> [M, N]. See the module docstring; `kernel_options` as for `fp8_matmul`."""
    _check_operands(x, w, impl, IMPLS[:3] + ("mosaic",))  # the grouped form has no xla_fp8 path
    _check_scales(w, w_scale, block, input_scale, stacked=1)
    choice = "mosaic" if impl == "mosaic" else resolve_impl(
        _gpu_paths_or_reference(impl, interpret), interpret, block and pallas_problem(block), "fp8_grouped_matmul")
    if choice == "mosaic" or _auto_takes_mosaic(impl, choice, block, w.shape, interpret):
        _check_block_128(block, "mosaic")
        from .fp8_matmul_mosaic import fp8_block_grouped_matmul_mosaic

        x8, x_scale = quantize_activations(x, 128, pow2_scales=pow2_scales)
        return fp8_block_grouped_matmul_mosaic(x8, x_scale, w, w_scale, group_sizes, out_dtype=x.dtype,
                                               interpret=interpret, **kernel_options)
    if choice == "xla":
        return fp8_grouped_matmul_reference(x, w, w_scale, group_sizes, block=block, input_scale=input_scale,
                                            pow2_scales=pow2_scales)
    row_scales = None if block else input_scale[_expert_of_row(group_sizes, x.shape[0])]
    x8, x_scale, w_scale, kernel_block = _kernel_operands(x, w_scale, block, row_scales, pow2_scales, w.shape[1])
    return fp8_block_grouped_matmul(x8, x_scale, w, w_scale, group_sizes, block=kernel_block, out_dtype=x.dtype,
                                    interpret=interpret, **kernel_options)
