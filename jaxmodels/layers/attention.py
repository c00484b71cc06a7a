"""Grouped-query attention without positional encoding (Nemotron-H's `*` layers): dense causal over whole sequences,
and packed over a paged KV cache for the engine (the kernel and its reference are in pallas_kernels)."""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxmodels.layers.linear import linear
from jaxmodels.layers.tensor_parallel import TP, compiler_tp_size, manual_over_tp
from jaxmodels.step_context import StepContext


def masked_gqa(q, k, v, visible, *, scale: float):
    """Grouped-query softmax attention: q[N,T,H,d], k[N,S,Hk,d], v[N,S,Hk,dv], visible bool broadcastable to
    [N,T,S] -> [N,T,H,dv].

    Scores and softmax in float32; the probabilities are cast back to v's dtype before the value product, as
    transformers' eager attention does.
    """
    n, t, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(n, t, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("ntgrd,nsgd->ngrts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("ngrts,nsgd->ntgrd", probs, v).reshape(n, t, heads, v.shape[-1])


def causal_attention(q, k, v, *, scale: float, sliding_window: int | None = None):
    """Dense causal GQA over full sequences: q[B,T,H,d], k/v[B,T,Hk,d] -> [B,T,H,d]."""
    pos = jnp.arange(q.shape[1])
    visible = pos[:, None] >= pos[None, :]
    if sliding_window is not None:
        visible &= pos[:, None] - pos[None, :] < sliding_window
    return masked_gqa(q, k, v, visible[None], scale=scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One attention layer's paged keys and values, [num_pages, page_size, kv_heads, head_dim] each."""

    k: jax.Array
    v: jax.Array
    # Logical axes of each field (sharding/rules.py maps them to mesh axes): split by heads, like the projections
    # that fill them.
    AXES: ClassVar[dict] = {"k": ("page", None, "kv_head", None), "v": ("page", None, "kv_head", None)}


class GQAAttention(nnx.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rngs: nnx.Rngs,
                 dtype=jnp.float32, sliding_window: int | None = None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.q_proj = linear(hidden_size, num_heads * head_dim, axes=("embed", "heads"), rngs=rngs, dtype=dtype)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, axes=("embed", "heads"), rngs=rngs, dtype=dtype)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, axes=("embed", "heads"), rngs=rngs, dtype=dtype)
        self.o_proj = linear(num_heads * head_dim, hidden_size, axes=("heads", "embed"), rngs=rngs, dtype=dtype)

    def cache_shape(self, num_pages: int, page_size: int, dtype) -> KVCache:
        kv = jax.ShapeDtypeStruct((num_pages, page_size, self.num_kv_heads, self.head_dim), dtype)
        return KVCache(k=kv, v=kv)

    def __call__(self, x: jax.Array, step: StepContext | None = None, cache: KVCache | None = None):
        """Without a step: full causal sequences x[B, T, D] -> out[B, T, D], no cache.

        With one: the step's packed tokens x[T, D] -> (out[T, D], cache). Their keys and values are written to the
        paged cache at their positions, and each attends over everything cached for its sequence up to itself
        (`pallas_kernels.paged_attention`).
        """
        *lead, _ = x.shape
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        scale = self.head_dim**-0.5
        if step is None:
            out = causal_attention(q, k, v, scale=scale, sliding_window=self.sliding_window)
            return self.o_proj(out.reshape(*lead, -1))
        tp = compiler_tp_size()
        if tp > 1 and self.num_kv_heads % tp == 0:
            # The pages are split by KV heads over "tp" (sharding.rules) and so are q, k, v: each device attends
            # with its own heads over its own pages, not over gathered ones (see tensor_parallel).
            heads, pages = P(None, TP, None), KVCache(k=P(None, None, TP, None), v=P(None, None, TP, None))
            paged = functools.partial(_paged, scale=scale)
            out, cache = manual_over_tp(paged, (heads, heads, heads, pages, P()), (heads, pages))(q, k, v, cache, step)
        else:
            out, cache = _paged(q, k, v, cache, step, scale=scale)
        return self.o_proj(out.reshape(*lead, -1)), cache


def _paged(q, k, v, cache: KVCache, step: StepContext, *, scale: float):
    """The step's keys and values written to the paged cache, then each token's attention over its sequence's pages
    -> (out [T, H, d], cache)."""
    cache = KVCache(k=step.write(cache.k, k), v=step.write(cache.v, v))
    out = pallas_kernels.paged_attention(q, cache.k, cache.v, page_table=step.sequence_pages,
                                         cu_seqlens=step.cu_seqlens, positions=step.positions, scale=scale)
    return out, cache
