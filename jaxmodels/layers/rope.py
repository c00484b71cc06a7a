"""Rotary position embeddings: frequencies (plain and YaRN), cos/sin tables, and the two channel layouts.

Layouts of the rotated channels:
  * half-split (`apply_rope_half`): channel i pairs with i + dim/2 (Llama's `rotate_half`); DeepSeek-V3.2's indexer.
  * interleaved (`apply_rope_interleaved`): channels (2i, 2i+1) form a pair (DeepSeek's MLA, GLM-5's indexer). Like
    transformers, the result comes out *de-interleaved* (all rotated first members, then all second members). Queries
    and keys get the same permutation, so their dot products are unchanged; a cache of roped keys must simply be
    written by the same function that ropes the queries.

YaRN follows transformers' `_compute_yarn_parameters`: blended inverse frequencies, and an `attention_factor` that
multiplies cos/sin (so it scales q·k twice). Separately, DeepSeek multiplies the softmax scale by
`mscale(factor, mscale_all_dim)²` (`softmax_scale_multiplier`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.configs.rope import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=None)
def inverse_frequencies(rope: RopeConfig) -> np.ndarray:
    """float32[dim/2], computed in float32 in the same order as transformers so both sides rotate by equal angles."""
    dim = rope.dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.float32(rope.theta) ** exponents
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return extrapolation
    interpolation = (np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp would divide by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (np.float32(1) - ramp).astype(np.float32)
    return (interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight).astype(np.float32)


def attention_factor(rope: RopeConfig) -> float:
    """Multiplier of cos and sin (YaRN's attention temperature; 1 for plain RoPE)."""
    if rope.rope_type == "default":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def softmax_scale_multiplier(rope: RopeConfig) -> float:
    """DeepSeek's YaRN correction of the attention softmax scale: `mscale(factor, mscale_all_dim)²`."""
    if rope.rope_type == "default" or not rope.mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def rope_cos_sin(positions: jax.Array, rope: RopeConfig) -> tuple[jax.Array, jax.Array]:
    """positions int[...] -> (cos, sin) float32[..., dim/2], both times `attention_factor`."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(rope))
    factor = attention_factor(rope)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def _rotate(first, second, cos, sin):
    cos, sin = cos.astype(first.dtype), sin.astype(first.dtype)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[..., dim] with pairs (2i, 2i+1); cos/sin broadcastable to [..., dim/2]. Output de-interleaved (see above)."""
    return _rotate(x[..., 0::2], x[..., 1::2], cos, sin)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[..., dim] with pairs (i, i + dim/2); cos/sin broadcastable to [..., dim/2]."""
    half = x.shape[-1] // 2
    return _rotate(x[..., :half], x[..., half:], cos, sin)
