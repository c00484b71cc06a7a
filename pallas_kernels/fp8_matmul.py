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

The XLA reference quantizes the activations as above, dequantizes both operands to float32 and takes one float32 dot
at HIGHEST precision: the products and scales an FP8 tensor-core GEMM with float32 accumulation applies, summed in
another order. It is the oracle a GPU kernel is tested against; the kernel goes behind these same functions
(`impl`), as the other kernels of this package do. Until then every `impl` runs the reference, on the GPU too: for
large models there, load with quantization="dequantize".
"""

import jax
import jax.numpy as jnp
from jax import lax

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
AMAX_FLOOR = 1e-4  # DeepSeek's act_quant clamps a group's amax here
IMPLS = ("auto", "xla")  # the GPU kernel will add "pallas" (and take "auto" on the GPU)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _repeat_to(scale: jax.Array, block: int, size: int, axis: int) -> jax.Array:
    """Block scales along `axis` expanded to one per element: [.., ⌈size/block⌉, ..] -> [.., size, ..]."""
    return lax.slice_in_dim(jnp.repeat(scale, block, axis=axis), 0, size, axis=axis)


def _pow2_at_or_above(x: jax.Array) -> jax.Array:
    """The smallest power of two >= x > 0, exactly (exp2 and log2 are not exact on every backend)."""
    mantissa, exponent = jnp.frexp(x)  # x = mantissa · 2^exponent, mantissa in [0.5, 1)
    return jnp.ldexp(jnp.ones_like(x), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def quantize_activations(x: jax.Array, group: int, *, pow2_scales: bool = False):
    """x[..., K] -> (float8_e4m3fn x8[..., K], float32 scales[..., ⌈K/group⌉]) with x ≈ x8 · scale, one scale per
    `group` consecutive channels of each row (a partial last group has its own)."""
    xf = x.astype(jnp.float32)
    k = x.shape[-1]
    groups = -(-k // group)
    padded = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, groups * group - k)])  # zeros leave every amax as it is
    grouped = padded.reshape(*x.shape[:-1], groups, group)
    scale = jnp.maximum(jnp.abs(grouped).max(-1), AMAX_FLOOR) * jnp.float32(1 / FP8_MAX)
    if pow2_scales:
        scale = _pow2_at_or_above(scale)
    # amax · (1 / scale) may round a hair past 448, which the cast would turn into NaN.
    x8 = jnp.clip(grouped * jnp.reciprocal(scale)[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return x8.reshape(*x.shape[:-1], groups * group)[..., :k], scale


def dequantize_activations(x8: jax.Array, scale: jax.Array, group: int) -> jax.Array:
    """The float32 values `quantize_activations` stands for."""
    return x8.astype(jnp.float32) * _repeat_to(scale, group, x8.shape[-1], axis=-1)


def quantize_static(x: jax.Array, input_scale: jax.Array) -> jax.Array:
    """x quantized with a static per-tensor scale and dequantized again: float32 e4m3(clip(x / s, ±448)) · s."""
    x8 = jnp.clip(x.astype(jnp.float32) * jnp.reciprocal(input_scale), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return x8.astype(jnp.float32) * input_scale


def dequantize_weight(w: jax.Array, w_scale: jax.Array, block: tuple[int, int] | None) -> jax.Array:
    """float32 weights from FP8 w[..., N, K] and their scales: block-scaled [..., ⌈N/bn⌉, ⌈K/bk⌉] (`block` = (bn, bk)),
    or per-tensor (`block` None) with one scale per leading index ([] for one weight, [E] for a stack)."""
    wf = w.astype(jnp.float32)
    if block is None:
        return wf * jnp.reshape(w_scale, w_scale.shape + (1, 1))
    n, k = w.shape[-2:]
    scale = _repeat_to(_repeat_to(w_scale, block[0], n, axis=-2), block[1], k, axis=-1)
    return wf * scale


def _dequantized_input(x, block, input_scale, pow2_scales):
    """float32 activations as the GEMM sees them: quantized per token and column block, or with the static scale
    (`input_scale` broadcastable to x's rows)."""
    if block is None:
        return quantize_static(x, input_scale)
    x8, scale = quantize_activations(x, block[1], pow2_scales=pow2_scales)
    return dequantize_activations(x8, scale, block[1])


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
        expected = lead + (-(-n // block[0]), -(-k // block[1]))
    if tuple(w_scale.shape) != expected:
        raise ValueError(f"weight {tuple(w.shape)} with block {block} needs scales of shape {expected}, got "
                         f"{tuple(w_scale.shape)}")


def fp8_matmul_reference(x, w, w_scale, *, block, input_scale=None, pow2_scales=False):
    xd = _dequantized_input(x, block, input_scale, pow2_scales)
    wd = dequantize_weight(w, w_scale, block)
    out = jnp.dot(xd, wd.T, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def fp8_matmul(x, w, w_scale, *, block: tuple[int, int] | None, input_scale=None, pow2_scales: bool = False,
               impl: str = "auto"):
    """x[M, K] @ FP8 w[N, K]ᵀ -> [M, N]. See the module docstring."""
    _check_impl(impl)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x has K={x.shape[-1]}, w {tuple(w.shape)} has K={w.shape[-1]}")
    _check_scales(w, w_scale, block, input_scale, stacked=0)
    return fp8_matmul_reference(x, w, w_scale, block=block, input_scale=input_scale, pow2_scales=pow2_scales)


def fp8_grouped_matmul_reference(x, w, w_scale, group_sizes, *, block, input_scale=None, pow2_scales=False):
    sizes = group_sizes.astype(jnp.int32)
    if block is None:  # each row is quantized with its expert's input scale
        expert_of_row = jnp.repeat(jnp.arange(w.shape[0]), sizes, total_repeat_length=x.shape[0])
        input_scale = input_scale[expert_of_row][:, None]
    xd = _dequantized_input(x, block, input_scale, pow2_scales)
    wd = dequantize_weight(w, w_scale, block)
    out = lax.ragged_dot(xd, wd.transpose(0, 2, 1), sizes, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def fp8_grouped_matmul(x, w, w_scale, group_sizes, *, block: tuple[int, int] | None, input_scale=None,
                       pow2_scales: bool = False, impl: str = "auto"):
    """Rows x[M, K] sorted by expert, expert g taking group_sizes[g] rows, each times its expert's FP8 w[g]ᵀ (w[E, N,
    K]) -> [M, N]. See the module docstring."""
    _check_impl(impl)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x has K={x.shape[-1]}, w {tuple(w.shape)} has K={w.shape[-1]}")
    _check_scales(w, w_scale, block, input_scale, stacked=1)
    return fp8_grouped_matmul_reference(x, w, w_scale, group_sizes, block=block, input_scale=input_scale,
                                        pow2_scales=pow2_scales)
