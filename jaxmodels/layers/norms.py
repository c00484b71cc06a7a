"""RMS norms: the plain one and Mamba2's gated, grouped one."""

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxmodels.layers import decode_fusions
from pallas_kernels.add_rms_norm import rms_norm, rms_normalize


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale named `weight` (as in HF).

    `scale_in_float32=True` multiplies the weight in float32 and casts the product (Nemotron-H); False casts the
    normalized input first and multiplies in the weight's dtype (Llama/DeepSeek). Both are equal in float32.
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, scale_in_float32: bool = True):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], eps=self.eps, scale_in_float32=self.scale_in_float32)

    def add_and_norm(self, hidden: jax.Array, delta: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """(hidden + delta, this norm of it): the residual stream's add and the next norm, one kernel on the GPU
        (pallas_kernels.add_rms_norm, unless JAXMODELS_DECODE_FUSIONS=0: see decode_fusions; then XLA's add
        and norm). Without a delta, (hidden, the norm of hidden)."""
        if delta is None:
            return hidden, self(hidden)
        return pallas_kernels.add_rms_norm(delta, hidden, self.weight[...], eps=self.eps,
                                           scale_in_float32=self.scale_in_float32,
                                           impl="auto" if decode_fusions.ENABLED else "xla")


class GatedGroupRMSNorm(nnx.Module):
    """Mamba2's output norm: `y * silu(z)` first, then RMS over each group of `group_size` channels, then weight."""

    def __init__(self, dim: int, group_size: int, eps: float, *, dtype=jnp.float32):
        if dim % group_size:
            raise ValueError(f"norm size {dim} is not a multiple of its group size {group_size}")
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))
        self.group_size = group_size
        self.eps = eps

    def __call__(self, y: jax.Array, gate: jax.Array) -> jax.Array:
        gated = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = gated.reshape(*gated.shape[:-1], -1, self.group_size)
        normed = rms_normalize(grouped, self.eps).reshape(gated.shape)
        # Weight multiply in float32, one rounding to y's dtype (transformers and mamba_ssm round once, here).
        return (self.weight[...].astype(jnp.float32) * normed).astype(y.dtype)
