"""The DSA lightning indexer: which keys each query attends to.

Score of query t against key j: `Σ_h w_h(t) · relu(q_h(t) · k(j)) · D^-1/2` with `w = weights_proj(x) · H^-1/2`,
`q = wq_b(q latent)` per head and `k = LayerNorm(wk(x))` shared by all heads; RoPE on the leading
`qk_rope_head_dim` channels of both (half-split for DeepSeek-V3.2, interleaved for GLM-5, as in transformers).
Every query keeps the `topk` best keys among those it can see (causal), via `pallas_kernels.indexer_topk`.

Numerics (`config.indexer_numerics`):
  * `exact`: q and k as computed, scores in float32 (transformers).
  * `reference`: DeepSeek's inference code. q and k are rotated by an orthonormal Hadamard matrix (dot products
    unchanged, outliers spread over all channels) and quantized to FP8 e4m3 with one power-of-two scale per
    128 values; the scales multiply the float32 scores (q's folded into the head weights, k's applied by the kernel
    after the head sum: relu(c·s) = c·relu(s) for c > 0). Index heads of up to 128 channels hold one block, so every
    (token, head) query and every key has exactly one scale.

The layer is split the way a serving step uses it: `keys` (what the index-key cache stores for new tokens),
`queries` (per query token) and `select` (top-k over a cache); `select_full` runs them on whole sequences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from jaxmodels.layers.linear import linear
from jaxmodels.layers.rope import apply_rope_half, apply_rope_interleaved

QUANT_BLOCK = 128  # values per FP8 scale in DeepSeek's reference code


class LayerNorm(nnx.Module):
    """LayerNorm with `weight` and `bias` (HF names), statistics in float32."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        normed = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix [n, n] (n a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def quantize_fp8_pow2(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x[..., D] (D <= 128, one block) -> (float8_e4m3fn values, float32 scale[...]) with x ≈ values · scale.

    The scale is the power of two at or above amax / 448 (DeepSeek's `ue8m0` format), so that dequantizing is exact
    scaling and the largest magnitude lands in (224, 448]: DeepSeek's act_quant with one group per row.
    """
    values, scale = pallas_kernels.quantize_activations(x, x.shape[-1], pow2_scales=True)
    return values, scale[..., 0]


class LightningIndexer(nnx.Module):
    def __init__(self, *, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int,
                 topk: int, rope_interleaved: bool, numerics: str = "exact", rngs: nnx.Rngs, dtype=jnp.float32):
        if numerics == "reference" and head_dim > QUANT_BLOCK:
            raise ValueError(f"reference numerics keep one FP8 scale per head: head_dim {head_dim} > {QUANT_BLOCK}")
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.rope_interleaved, self.numerics = rope_interleaved, numerics
        self.wq_b = linear(q_lora_rank, n_heads * head_dim, axes=("latent", "indexer"), rngs=rngs, dtype=dtype)
        self.wk = linear(hidden_size, head_dim, axes=("embed", "indexer"), rngs=rngs, dtype=dtype)
        self.k_norm = LayerNorm(head_dim, 1e-6, dtype=dtype)
        # Float32 whatever the model dtype: transformers keeps `indexer.weights_proj` in float32 too.
        self.weights_proj = linear(hidden_size, n_heads, axes=("embed", "indexer"), rngs=rngs, dtype=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST)

    def _rope(self, x, cos, sin):
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim:]
        rotate = apply_rope_interleaved if self.rope_interleaved else apply_rope_half
        return jnp.concatenate([rotate(rot, cos, sin), rest], axis=-1)

    def _rotate_hadamard(self, x):
        return jnp.dot(x.astype(jnp.float32), jnp.asarray(hadamard_matrix(self.head_dim)),
                       precision=jax.lax.Precision.HIGHEST)

    def keys(self, hidden: jax.Array, cos: jax.Array, sin: jax.Array):
        """hidden[..., D], cos/sin[..., rope/2] -> (k[..., Di], k_scale[...] or None): what the key cache stores.

        `exact`: k in the model dtype, no scale. `reference`: float8_e4m3fn k and its float32 per-token scale.
        """
        k = self._rope(self.k_norm(self.wk(hidden)), cos, sin)
        if self.numerics == "exact":
            return k, None
        return quantize_fp8_pow2(self._rotate_hadamard(k))

    def queries(self, hidden: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array):
        """-> (q[..., Hi, Di], weights float32[..., Hi]) with every scale but the key's folded into the weights."""
        q = self.wq_b(q_latent).reshape(*q_latent.shape[:-1], self.n_heads, self.head_dim)
        q = self._rope(q, cos[..., None, :], sin[..., None, :])
        weights = self.weights_proj(hidden.astype(jnp.float32)) * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        if self.numerics == "exact":
            return q, weights
        q8, q_scale = quantize_fp8_pow2(self._rotate_hadamard(q))
        # FP8 values are exact in bfloat16, which every kernel path accepts as a query dtype.
        return q8.astype(jnp.bfloat16), weights * q_scale

    def select(self, q, weights, k_cache, *, kv_lens, topk: int, k_scale=None, page_table=None, seq_ids=None):
        """int32[T, topk] logical key positions (−1 pads) for packed queries q[T, Hi, Di] over `k_cache`.

        Cache layouts and `kv_lens` as in `pallas_kernels.indexer_topk` (a query sees keys 0 .. kv_lens-1).
        """
        return pallas_kernels.indexer_topk(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                                           seq_ids=seq_ids, k_scale=k_scale)

    def select_full(self, hidden: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """Whole causal sequences hidden[B, T, D] -> int32[B·T, min(topk, T)] positions within each row's sequence."""
        batch, seq = hidden.shape[:2]
        k, k_scale = self.keys(hidden, cos, sin)  # the contiguous cache [B, T, Di] of the batch's own keys
        q, weights = self.queries(hidden, q_latent, cos, sin)
        kv_lens, seq_ids = causal_layout(batch, seq)
        return self.select(q.reshape(batch * seq, self.n_heads, self.head_dim), weights.reshape(batch * seq, -1), k,
                           kv_lens=kv_lens, topk=min(self.topk, seq), k_scale=k_scale, seq_ids=seq_ids)


def causal_layout(batch: int, seq: int) -> tuple[jax.Array, jax.Array]:
    """Packed-query metadata of B causal rows of T tokens: (kv_lens[B·T] = position + 1, seq_ids[B·T] = row)."""
    kv_lens = jnp.tile(jnp.arange(1, seq + 1, dtype=jnp.int32), batch)
    seq_ids = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), seq)
    return kv_lens, seq_ids
