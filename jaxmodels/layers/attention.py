"""Grouped-query attention without positional encoding (Nemotron-H's `*` layers)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.linear import linear


def causal_attention(q, k, v, *, scale: float, sliding_window: int | None = None):
    """Dense causal GQA over full sequences: q[B,T,H,d], k/v[B,T,Hk,d] -> [B,T,H,d].

    Scores and softmax in float32; the probabilities are cast back to q's dtype before the value product, as
    transformers' eager attention does.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btgrd,bsgd->bgrts", q, k, preferred_element_type=jnp.float32) * scale
    pos = jnp.arange(seq)
    visible = pos[:, None] >= pos[None, :]
    if sliding_window is not None:
        visible &= pos[:, None] - pos[None, :] < sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, v)
    return out.reshape(batch, seq, heads, head_dim)


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
