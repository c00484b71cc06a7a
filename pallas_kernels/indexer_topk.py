"""DSA lightning-indexer logits fused with an exact top-k selection, as Pallas (Triton) kernels + an XLA reference.

Score of query t against key j: `Σ_h weights[t, h] · relu(q[t, h] · k[j])` (float32). The caller folds every
scale into `weights` (DeepSeek-V3.2: `weights = w_proj(x) · Hi^-0.5 · D^-0.5`, and the FP8 query scale if any);
this module only multiplies by the FP8 per-token key scale, after the head sum, which is exact because
`relu(c·x) = c·relu(x)` for `c > 0`.

Index-K cache layouts (`k_cache`):
  * paged: `k_cache[num_pages, page_size, D]` with `page_table[S, max_pages]` int32 (page ids of sequence s in
    order; logical position `j` of sequence s lives at `k_cache[page_table[s, j // page_size], j % page_size]`)
    and `seq_ids[T]` int32 (sequence of each query). `page_size` must be a power of two for the Pallas kernel.
  * contiguous: `page_table=None`, `k_cache[S, L, D]` (one row of L keys per sequence); same as paged with
    `page_size = L` and `page_table = arange(S)[:, None]`. `seq_ids=None` means every query is sequence 0.
  * dtype bf16 / float32, or FP8 (DeepSeek's layout): `k_cache` float8_e4m3fn plus `k_scale[num_pages, page_size]`
    float32 (contiguous form: `[S, L]`), one scale per token, dequantised key `k8 · scale`
    (`quantize_index_k_fp8` builds it).
Per-query metadata: `kv_lens[T]` int32 = number of keys query t sees (keys `0 .. kv_lens[t]-1`): a prefill query
at position p passes `p + 1`, a decode query passes the sequence length, a padding token passes 0 (all −1 out).

Output: int32[T, topk] logical token positions within the query's sequence (not cache rows; see
`sparse_mla_attention.logical_to_cache_rows`), in no particular order; rows with fewer than `topk` visible keys
hold all of them, then −1. Ties at the k-th value keep the lowest positions (the same rule as `lax.top_k`).

Pallas path (two kernels, Triton lowering, `interpret=True` on CPU):
  1. `_index_logits`: grid (query blocks × key blocks). Each program loads one key tile per sequence present in its
     query block (K tile reused by all its queries), does `[Hi, D] @ [D, KB]` on the tensor cores per query,
     relu, weights, head-sum, FP8 scale, masks with -inf past `kv_lens`, and skips tiles past the block's
     longest row. Writes float32 logits `[T, Npad]`.
  2. `_select_topk`: one program per row; an exact selection without sorting:
     a. pass over the row: order-preserving int32 keys, max over groups of G=4 keys -> `gmax` (scratch);
     b. binary search (32 counting passes over `gmax`, N/4 values) for the k-th largest group max `t_lo`. At
        least k groups hold a key >= t_lo, so the k-th largest key is >= t_lo, and keys >= t_lo sit in at most
        ~k groups: at most 4k candidates (more only with ties at t_lo);
     c. second pass over the row compacts candidates (key, position) with a prefix sum into a 4k scratch;
     d. binary search on the bit pattern (32 counting passes over <= 4k candidates) for the exact k-th largest
        key T*, then one compaction pass writes every candidate > T* plus the first ties == T*.
     If ties overflow the 4k scratch (rare: many equal logits), the row falls back to the same search and
     compaction over the whole row. Work per row: two reads of the row plus 32 passes over N/4 + 4k values,
     against a full sort's log²N passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import resolve_impl

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_k_fp8(k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k[..., D] -> (float8_e4m3fn k[..., D], float32 scale[...]): one scale per token, amax / 448."""
    kf = k.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(kf), axis=-1), 1e-12) / FP8_MAX
    k8 = (kf / scale[..., None]).astype(jnp.float8_e4m3fn)
    return k8, scale


def _normalise_layout(k_cache, k_scale, page_table, seq_ids, T):
    """Contiguous form -> paged form with one page per sequence."""
    if page_table is None:
        page_table = jnp.arange(k_cache.shape[0], dtype=jnp.int32)[:, None]
    if seq_ids is None:
        seq_ids = jnp.zeros((T,), jnp.int32)
    return k_cache, k_scale, page_table.astype(jnp.int32), seq_ids.astype(jnp.int32)


def index_logits_reference(q, weights, k_cache, *, kv_lens, page_table=None, seq_ids=None, k_scale=None):
    """float32 logits[T, max_pages * page_size]; -inf where j >= kv_lens[t]. Plain XLA, float32 throughout."""
    T, Hi, D = q.shape
    k_cache, k_scale, page_table, seq_ids = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    page_size = k_cache.shape[1]
    n_keys = page_table.shape[1] * page_size
    keys = k_cache[page_table].reshape(page_table.shape[0], n_keys, D).astype(jnp.float32)  # [S, N, D]
    keys_q = keys[seq_ids]  # [T, N, D]
    s = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), keys_q, precision=lax.Precision.HIGHEST)
    logits = jnp.einsum("thn,th->tn", jax.nn.relu(s), weights.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    if k_scale is not None:
        scales = k_scale[page_table].reshape(page_table.shape[0], n_keys).astype(jnp.float32)
        logits = logits * scales[seq_ids]
    valid = jnp.arange(n_keys)[None, :] < kv_lens[:, None]
    return jnp.where(valid, logits, -jnp.inf)


def topk_reference(logits, kv_lens, topk):
    """Exact top-k over valid entries with `lax.top_k` (a sort); −1 where fewer than topk are valid."""
    T, N = logits.shape
    if N < topk:
        logits = jnp.pad(logits, ((0, 0), (0, topk - N)), constant_values=-jnp.inf)
    _, idx = lax.top_k(logits, topk)
    n_valid = jnp.minimum(kv_lens, N)
    # top_k puts the valid (finite) entries first; its positions among them are ranks, so rank < n_valid is valid.
    return jnp.where(jnp.arange(topk)[None, :] < n_valid[:, None], idx, -1).astype(jnp.int32)


def indexer_topk_reference(q, weights, k_cache, *, kv_lens, topk, page_table=None, seq_ids=None, k_scale=None):
    logits = index_logits_reference(q, weights, k_cache, kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids,
                                    k_scale=k_scale)
    return topk_reference(logits, kv_lens.astype(jnp.int32), topk)


def indexer_topk(q, weights, k_cache, *, kv_lens, topk: int, page_table=None, seq_ids=None, k_scale=None,
                 impl: str = "auto", interpret: bool = False):
    """Top-k key positions per query; see the module docstring for layouts. Returns int32[T, topk], −1 padded."""
    kv_lens = kv_lens.astype(jnp.int32)
    if resolve_impl(impl, interpret) == "xla":
        return indexer_topk_reference(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                                      seq_ids=seq_ids, k_scale=k_scale)
    return indexer_topk_pallas(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                               seq_ids=seq_ids, k_scale=k_scale, interpret=interpret)
