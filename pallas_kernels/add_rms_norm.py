"""The residual stream's add and the next RMSNorm in one pass: Pallas kernel and XLA reference.

`add_rms_norm(x[T, D], residual[T, D], weight[D], *, eps, scale_in_float32) -> (summed, normed)`, both [T, D]:

    summed = residual + x                       rounded to the inputs' dtype, as the add alone rounds it
    normed = rms_norm(summed) * weight          in float32 over each row: summed / sqrt(mean(summed²) + eps)

`scale_in_float32=True` multiplies the weight in float32 and rounds the product to x's dtype (Nemotron-H); False
rounds the normalized row to x's dtype first and multiplies in the weight's dtype (Llama / DeepSeek). `rms_norm` is
the norm alone (the reference for both, and what the models' RMSNorm computes).

Why a kernel: between two layers XLA runs the add, the sum of squares and the scaling as three kernels (the add's
output is both the next residual and the norm's input), each a node of the step's CUDA graph and each tiny at decode.
The kernel reads x and the residual once and writes both outputs: one program per row, the row in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import next_pow2, resolve_impl

_f32 = jnp.float32


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    x = x.astype(_f32)
    return x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float, scale_in_float32: bool = True) -> jax.Array:
    """RMSNorm of x's last axis with a learned scale (see the module docstring for `scale_in_float32`)."""
    normed = rms_normalize(x, eps)
    if scale_in_float32:
        return (weight.astype(_f32) * normed).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def add_rms_norm_reference(x, residual, weight, *, eps: float, scale_in_float32: bool = True):
    summed = residual + x
    return summed, rms_norm(summed, weight, eps=eps, scale_in_float32=scale_in_float32)


def _kernel(x_ref, r_ref, w_ref, sum_ref, out_ref, *, D, BD, eps, scale_in_float32):
    row = pl.program_id(0)
    mask = lax.broadcasted_iota(jnp.int32, (BD,), 0) < D
    x = plgpu.load(x_ref.at[row, pl.ds(0, BD)], mask=mask, other=0.0)
    r = plgpu.load(r_ref.at[row, pl.ds(0, BD)], mask=mask, other=0.0)
    summed = (r.astype(_f32) + x.astype(_f32)).astype(sum_ref.dtype)  # the add's one rounding
    plgpu.store(sum_ref.at[row, pl.ds(0, BD)], summed, mask=mask)
    s = summed.astype(_f32)
    normed = s * lax.rsqrt(jnp.sum(s * s) / D + eps)  # masked lanes are 0: they add nothing
    w = plgpu.load(w_ref.at[pl.ds(0, BD)], mask=mask, other=0.0).astype(_f32)
    if not scale_in_float32:
        normed = normed.astype(x_ref.dtype).astype(_f32)
    plgpu.store(out_ref.at[row, pl.ds(0, BD)], (w * normed).astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "scale_in_float32", "interpret"))
def _add_rms_norm_pallas(x, residual, weight, *, eps, scale_in_float32, interpret):
    T, D = x.shape
    BD = next_pow2(D)
    out_dtype = x.dtype if scale_in_float32 else jnp.result_type(weight.dtype, x.dtype)
    kernel = functools.partial(_kernel, D=D, BD=BD, eps=eps, scale_in_float32=scale_in_float32)
    return pl.pallas_call(
        kernel,
        grid=(T,),
        out_shape=(jax.ShapeDtypeStruct((T, D), x.dtype), jax.ShapeDtypeStruct((T, D), out_dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=4 if BD <= 4096 else 8, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, residual, weight)


def add_rms_norm(x, residual, weight, *, eps: float, scale_in_float32: bool = True, impl: str = "auto",
                 interpret: bool = False):
    """See the module docstring. Leading dimensions of x and residual (equal shapes) are flattened into rows."""
    if x.shape != residual.shape or x.dtype != residual.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"x{x.shape} {x.dtype}, residual{residual.shape} {residual.dtype} and weight{weight.shape} "
                         f"do not match")
    if resolve_impl(impl, interpret, kernel="add_rms_norm") == "xla":
        return add_rms_norm_reference(x, residual, weight, eps=eps, scale_in_float32=scale_in_float32)
    rows = (-1, x.shape[-1])
    summed, normed = _add_rms_norm_pallas(x.reshape(rows), residual.reshape(rows), weight, eps=eps,
                                          scale_in_float32=scale_in_float32, interpret=interpret)
    return summed.reshape(x.shape), normed.reshape(x.shape)
