"""Multi-head latent attention (DeepSeek MLA) with DSA sparse key selection.

Per token: `q = q_b_proj(RMSNorm(q_a_proj(x)))` split per head into (nope, rope); `kv_a_proj_with_mqa(x)` gives the
latent `c` (RMSNorm'ed, `kv_lora_rank` wide) and one shared rope key; interleaved RoPE on both rope parts. What a
cache keeps per token is one latent row `[c ‖ k_rope]` (512 + 64 in the real models).

Two ways to attend, equal in exact arithmetic:
  * expanded (MHA-style, prefill): `kv_b_proj(c)` gives each head's key nope part and value; scores over
    `[k_nope ‖ k_rope]`.
  * absorbed (decode): `kv_b_proj = [W_UK | W_UV]` per head; the query is moved into latent space,
    `q_lat = q_nope · W_UKᵀ`, and scored against the latent rows directly (`q_lat·c + q_rope·k_rope` equals
    `q_nope·k_nope + q_rope·k_rope`); the latent-space output is mapped to values by `W_UV`. This is what
    `pallas_kernels.sparse_mla_attention` computes over the selected cache rows.

Softmax scale: `qk_head_dim^-1/2`, times DeepSeek's YaRN `mscale²` when the rope is YaRN.
"""

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxmodels.layers.attention import masked_gqa
from jaxmodels.layers.indexer import LightningIndexer, causal_layout
from jaxmodels.layers.linear import kernel_of, linear
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.layers.rope import apply_rope_interleaved, softmax_scale_multiplier
from jaxmodels.step_context import StepContext

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps
MLA_PATHS = ("absorbed", "expanded")


def selection_mask(indices: jax.Array, num_keys: int) -> jax.Array:
    """indices int32[N, k] (−1 = none) -> bool[N, num_keys], True at the selected keys."""
    rows = jnp.arange(indices.shape[0])[:, None]
    cols = jnp.where(indices >= 0, indices, num_keys)  # −1 goes out of range and is dropped
    return jnp.zeros((indices.shape[0], num_keys), bool).at[rows, cols].set(True, mode="drop")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLACache:
    """One MLA layer's paged caches, [num_pages, page_size, ...] each (page 0 is the null page): the latent rows
    `[c ‖ k_rope]` (model dtype) and, for a layer with its own indexer, the index keys (`index_k`, FP8 with a
    float32 `index_k_scale` per key under the reference numerics). GLM-5's shared layers have neither index field."""

    latent: jax.Array
    index_k: jax.Array | None = None
    index_k_scale: jax.Array | None = None
    # Whole on every device: the latent row is shared by all heads, so a head split would still need every row.
    AXES: ClassVar[dict] = {"latent": ("page", None, None), "index_k": ("page", None, None),
                            "index_k_scale": ("page", None)}


class MLAttention(nnx.Module):
    def __init__(self, config, *, with_indexer: bool, rngs: nnx.Rngs, dtype=jnp.float32):
        """`config`: a DSA config (jaxmodels.configs.deepseek_v32)."""
        c = config
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.scale = c.qk_head_dim ** -0.5 * softmax_scale_multiplier(c.rope)
        self.q_a_proj = linear(c.hidden_size, c.q_lora_rank, axes=("embed", "latent"), rngs=rngs,
                               bias=c.attention_bias, dtype=dtype)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype=dtype, scale_in_float32=False)
        self.q_b_proj = linear(c.q_lora_rank, c.num_attention_heads * c.qk_head_dim, axes=("latent", "mla_heads"),
                               rngs=rngs, dtype=dtype)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, axes=("embed", "latent"),
                                         rngs=rngs, bias=c.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype=dtype, scale_in_float32=False)
        self.kv_b_proj = linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                axes=("latent", "mla_heads"), rngs=rngs, dtype=dtype)
        self.o_proj = linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, axes=("mla_heads", "embed"),
                             rngs=rngs, bias=c.attention_bias, dtype=dtype)
        # GLM-5's "shared" layers have no indexer of their own: they reuse the previous layer's selection.
        self.indexer = LightningIndexer(
            hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank, n_heads=c.index_n_heads,
            head_dim=c.index_head_dim, rope_dim=c.qk_rope_head_dim, topk=c.index_topk,
            rope_interleaved=c.indexer_rope_interleaved, numerics=c.indexer_numerics, rngs=rngs,
            dtype=dtype) if with_indexer else None

    # ---- per-token projections (no cache) -------------------------------------------------------------------------

    def project(self, hidden: jax.Array, cos: jax.Array, sin: jax.Array):
        """hidden[..., D], cos/sin[..., rope/2] -> (q_nope[..., H, dn], q_rope[..., H, dr], latent[..., Dl + dr],
        q_latent[..., q_lora_rank]). `latent` is the cache row; `q_latent` feeds the indexer."""
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_latent).reshape(*hidden.shape[:-1], self.num_heads, -1)
        q_nope, q_rope = q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim:]
        q_rope = apply_rope_interleaved(q_rope, cos[..., None, :], sin[..., None, :])
        compressed = self.kv_a_proj_with_mqa(hidden)
        c_kv = self.kv_a_layernorm(compressed[..., : self.kv_lora_rank])
        k_rope = apply_rope_interleaved(compressed[..., self.kv_lora_rank:], cos, sin)
        return q_nope, q_rope, jnp.concatenate([c_kv, k_rope], axis=-1), q_latent

    def _kv_b_heads(self):
        """kv_b_proj's kernel per head: (W_UK[Dl, H, dn], W_UV[Dl, H, dv]). An FP8 kv_b_proj is dequantized for these
        products, with no activation quantization, as DeepSeek's reference code does on its absorbed path."""
        w = kernel_of(self.kv_b_proj).reshape(self.kv_lora_rank, self.num_heads, -1)
        return w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim:]

    # ---- absorbed path --------------------------------------------------------------------------------------------

    def absorb_query(self, q_nope: jax.Array, q_rope: jax.Array) -> jax.Array:
        """-> q[..., H, Dl + dr] in latent space, for scoring against latent rows."""
        w_uk, _ = self._kv_b_heads()
        q_latent = jnp.einsum("...hd,chd->...hc", q_nope, w_uk)
        return jnp.concatenate([q_latent, q_rope], axis=-1)

    def output_from_latent(self, out_latent: jax.Array) -> jax.Array:
        """Attention output in latent space [..., H, Dl] -> values -> o_proj: [..., D]."""
        _, w_uv = self._kv_b_heads()
        values = jnp.einsum("...hc,chv->...hv", out_latent.astype(w_uv.dtype), w_uv)
        return self.o_proj(values.reshape(*values.shape[:-2], -1))

    def attend_absorbed(self, q_absorbed: jax.Array, latent_cache: jax.Array, cache_rows: jax.Array,
                        kv_lens: jax.Array) -> jax.Array:
        """Packed queries [T, H, Dl+dr] over the cache rows they selected (int32[T, k], −1 = none; a query seeing
        kv_lens[t] keys lists at most that many, first) -> [T, H, Dl]."""
        return pallas_kernels.sparse_mla_attention(q_absorbed, latent_cache, cache_rows, scale=self.scale,
                                                   kv_lora_rank=self.kv_lora_rank,
                                                   listed=jnp.minimum(kv_lens, cache_rows.shape[1]))

    # ---- expanded path --------------------------------------------------------------------------------------------

    def expand_latent(self, latent: jax.Array):
        """latent rows [..., S, Dl+dr] -> per-head keys [..., S, H, dn+dr] and values [..., S, H, dv]."""
        kv = self.kv_b_proj(latent[..., : self.kv_lora_rank]).reshape(*latent.shape[:-1], self.num_heads, -1)
        k_nope, values = kv[..., : self.qk_nope_head_dim], kv[..., self.qk_nope_head_dim:]
        k_rope = jnp.broadcast_to(latent[..., None, self.kv_lora_rank:], (*k_nope.shape[:-1], self.qk_rope_head_dim))
        return jnp.concatenate([k_nope, k_rope], axis=-1), values

    def attend_expanded(self, q_nope, q_rope, latent, visible):
        """q[B, T, H, *] over latent rows [B, S, Dl+dr] where visible[B, T, S] -> [B, T, H, dv]: multi-head
        attention over the expanded keys and values (`masked_gqa` with one query head per key head)."""
        keys, values = self.expand_latent(latent)
        return masked_gqa(jnp.concatenate([q_nope, q_rope], axis=-1), keys, values, visible, scale=self.scale)

    # ---- the forward ------------------------------------------------------------------------------------------------

    def cache_shape(self, num_pages: int, page_size: int, dtype) -> MLACache:
        """Latent rows in `dtype`; index keys in `dtype` under exact indexer numerics, else FP8 with a float32 scale
        per key."""
        pages = (num_pages, page_size)
        latent = jax.ShapeDtypeStruct(pages + (self.kv_lora_rank + self.qk_rope_head_dim,), dtype)
        if self.indexer is None:
            return MLACache(latent=latent)
        if self.indexer.numerics == "exact":
            return MLACache(latent=latent, index_k=jax.ShapeDtypeStruct(pages + (self.indexer.head_dim,), dtype))
        return MLACache(latent=latent,
                        index_k=jax.ShapeDtypeStruct(pages + (self.indexer.head_dim,), jnp.float8_e4m3fn),
                        index_k_scale=jax.ShapeDtypeStruct(pages, jnp.float32))

    def __call__(self, hidden: jax.Array, cos: jax.Array, sin: jax.Array, shared_indices: jax.Array | None = None,
                 *, step: StepContext | None = None, cache: MLACache | None = None, path: str = "absorbed"):
        """-> (out, indices), plus the updated cache with a step. `indices` are the selected key positions of each
        query; a layer without an indexer takes them from the previous layer (`shared_indices`).

        Without a step: whole causal sequences hidden[B, T, D], cos/sin[T, rope/2]; indices int32[B·T, k]. Both
        `path`s attend to exactly the selected keys.
        With one: the step's packed tokens hidden[T, D] write their latent rows (and index keys) at their positions,
        select among their request's positions 0..position and attend (absorbed) to those rows.
        """
        if path not in MLA_PATHS:
            raise ValueError(f"MLA path must be one of {MLA_PATHS}, got {path!r}")
        q_nope, q_rope, latent, q_latent = self.project(hidden, cos, sin)
        if self.indexer is None and shared_indices is None:
            raise ValueError("an MLA layer without an indexer needs the previous layer's top-k indices")
        if step is not None:
            return self._cached_step(hidden, cos, sin, shared_indices, step, cache, q_nope, q_rope, latent, q_latent)
        batch, seq = hidden.shape[:2]
        indices = shared_indices if self.indexer is None else self.indexer.select_full(hidden, q_latent, cos, sin)
        if path == "expanded":
            visible = selection_mask(indices, seq).reshape(batch, seq, seq)
            out = self.attend_expanded(q_nope, q_rope, latent, visible)
            return self.o_proj(out.reshape(batch, seq, -1)), indices
        q_absorbed = self.absorb_query(q_nope, q_rope).reshape(batch * seq, self.num_heads, -1)
        # The batch's own latent rows are the cache: row b's position j is flat row b·T + j.
        kv_lens, seq_ids = causal_layout(batch, seq)
        rows = pallas_kernels.logical_to_cache_rows(indices, jnp.arange(batch, dtype=jnp.int32)[:, None], seq_ids,
                                                    seq)
        out_latent = self.attend_absorbed(q_absorbed, latent, rows, kv_lens)
        return self.output_from_latent(out_latent.reshape(batch, seq, self.num_heads, -1)), indices

    def _cached_step(self, hidden, cos, sin, indices, step, cache, q_nope, q_rope, latent, q_latent):
        page_size = cache.latent.shape[1]
        latent_pages = step.write(cache.latent, latent)
        index_k, index_k_scale = cache.index_k, cache.index_k_scale
        if self.indexer is not None:  # GLM-5's shared layers keep the previous layer's selection
            keys, key_scale = self.indexer.keys(hidden, cos, sin)
            index_k = step.write(index_k, keys)
            if key_scale is not None:
                index_k_scale = step.write(index_k_scale, key_scale)
            q, weights = self.indexer.queries(hidden, q_latent, cos, sin)
            topk = min(self.indexer.topk, step.page_table.shape[1] * page_size)
            indices = self.indexer.select(q, weights, index_k, kv_lens=step.positions + 1, topk=topk,
                                          k_scale=index_k_scale, page_table=step.page_table, seq_ids=step.seq_ids)
        rows = pallas_kernels.logical_to_cache_rows(indices, step.page_table, step.seq_ids, page_size)
        out = self.attend_absorbed(self.absorb_query(q_nope, q_rope), latent_pages, rows, step.positions + 1)
        return self.output_from_latent(out), indices, MLACache(latent_pages, index_k, index_k_scale)
