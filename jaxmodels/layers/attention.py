"""Grouped-query attention without positional encoding (Nemotron-H's `*` layers): dense causal over whole sequences,
and packed over a paged KV cache for the engine (the kernel and its reference are in pallas_kernels)."""

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxmodels.layers.linear import linear


def masked_gqa(q, k, v, visible, *, scale: float):
    """Grouped-query softmax attention: q[N,T,H,d], k/v[N,S,Hk,d], visible bool broadcastable to [N,T,S] ->
    [N,T,H,d].

    Scores and softmax in float32; the probabilities are cast back to v's dtype before the value product, as
    transformers' eager attention does.
    """
    n, t, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(n, t, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("ntgrd,nsgd->ngrts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("ngrts,nsgd->ntgrd", probs, v).reshape(n, t, heads, head_dim)


def causal_attention(q, k, v, *, scale: float, sliding_window: int | None = None):
    """Dense causal GQA over full sequences: q[B,T,H,d], k/v[B,T,Hk,d] -> [B,T,H,d]."""
    pos = jnp.arange(q.shape[1])
    visible = pos[:, None] >= pos[None, :]
    if sliding_window is not None:
        visible &= pos[:, None] - pos[None, :] < sliding_window
    return masked_gqa(q, k, v, visible[None], scale=scale)


def write_pages(pages, new, token_pages, positions):
    """Store new[T,Hk,d] at each token's slot of a paged cache pages[num_pages, page_size, Hk, d].

    token_pages[T, P] is each token's page-table row; a padded token's row is all zeros, so it writes page 0, the
    null page no real request reads.
    """
    page_size = pages.shape[1]
    page = jnp.take_along_axis(token_pages, (positions // page_size)[:, None], axis=1)[:, 0]
    return pages.at[page, positions % page_size].set(new.astype(pages.dtype))


class GQAAttention(nnx.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, sliding_window: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.q_proj = linear(hidden_size, num_heads * head_dim, rngs=rngs, dtype=dtype)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, rngs=rngs, dtype=dtype)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, rngs=rngs, dtype=dtype)
        self.o_proj = linear(num_heads * head_dim, hidden_size, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q = self.q_proj(x).reshape(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, seq, self.num_kv_heads, self.head_dim)
        out = causal_attention(q, k, v, scale=self.head_dim**-0.5, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(batch, seq, -1))

    def forward_paged(self, x: jax.Array, k_pages, v_pages, *, token_pages, page_table, cu_seqlens, positions):
        """Packed tokens x[T,D] of the sequences of `cu_seqlens`[S+1] at `positions`[T], with paged KV caches:
        writes their keys and values, attends over everything cached for their sequence up to themselves
        (`pallas_kernels.paged_attention`) -> (out[T,D], k_pages, v_pages).

        token_pages[T, P] is each token's page-table row (zeros for padding tokens, so they write the null page);
        page_table[S, P] the sequences' rows.
        """
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        k_pages = write_pages(k_pages, k, token_pages, positions)
        v_pages = write_pages(v_pages, v, token_pages, positions)
        out = pallas_kernels.paged_attention(q, k_pages, v_pages, page_table=page_table, cu_seqlens=cu_seqlens,
                                             positions=positions, scale=self.head_dim**-0.5)
        return self.o_proj(out.reshape(num_tokens, -1)), k_pages, v_pages
