"""Cache pools past 2^31 elements (GPU only): the compiled kernels must address rows at the top of such a pool.

A long-context engine sizes its pools to the device memory, so one layer's KV, latent or index-key pool can hold more
than 2^31 elements (4.3 GB of bf16 KV per layer already does), and an element offset computed in int32 would wrap.
Each test writes a small problem at the very top of a pool just past that size, runs the kernel there, and
compares with the same kernel on the small pool alone. Paged attention and sparse MLA (bf16 pools) passed on the
H200; the indexer with FP8 keys did not until it took them as byte pairs (not yet run on a GPU: the engine still caps
its 1-byte pools at 2^31 elements, tests/engine/test_pool_sizing.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer_topk, paged_attention, quantize_index_k_fp8, sparse_mla_attention
from pallas_kernels._dispatch import needs_byte_pairs
from pallas_kernels.indexer_topk import indexer_topk_pallas

pytestmark = pytest.mark.gpu

INT32_LIMIT = 2**31


def pages_past_int32(page_elements: int, small_pages: int) -> int:
    """A page count whose pool has more than 2^31 elements, with room for `small_pages` above the limit."""
    return INT32_LIMIT // page_elements + small_pages + 1


def at_top(small: jax.Array, big_pages: int) -> jax.Array:
    """A zero pool of `big_pages` pages holding `small`'s pages as its last ones."""
    big = jnp.zeros((big_pages,) + small.shape[1:], small.dtype)
    return big.at[big_pages - small.shape[0]:].set(small)


def test_paged_attention_reads_pages_past_2_31_elements():
    heads, kv_heads, head_dim, page_size = 40, 8, 128, 16
    lengths = [300, 1]  # a chunk of 300 tokens of one sequence and a decode token of another, both at 1000+
    contexts = [1300, 2049]
    pages_per_seq = [-(-c // page_size) for c in contexts]
    small_pages = 1 + sum(pages_per_seq)
    key = jax.random.key(0)
    k_small, v_small, q = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) for i, shape in
                           enumerate([(small_pages, page_size, kv_heads, head_dim)] * 2 +
                                     [(sum(lengths), heads, head_dim)]))
    table = np.zeros((2, max(pages_per_seq)), np.int32)
    table[0, :pages_per_seq[0]] = np.arange(1, 1 + pages_per_seq[0])
    table[1, :pages_per_seq[1]] = np.arange(1 + pages_per_seq[0], small_pages)
    positions = np.concatenate([np.arange(contexts[0] - lengths[0], contexts[0]), [contexts[1] - 1]]).astype(np.int32)
    meta = dict(cu_seqlens=jnp.array([0, lengths[0], sum(lengths)], jnp.int32), positions=jnp.asarray(positions),
                scale=head_dim ** -0.5, impl="pallas")
    want = paged_attention(q, k_small, v_small, page_table=jnp.asarray(table), **meta)
    big_pages = pages_past_int32(page_size * kv_heads * head_dim, small_pages)
    shift = big_pages - small_pages
    big_table = jnp.asarray(np.where(table > 0, table + shift, 0), jnp.int32)
    got = paged_attention(q, at_top(k_small, big_pages), at_top(v_small, big_pages), page_table=big_table, **meta)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_sparse_mla_attention_reads_rows_past_2_31_elements():
    heads, dl, dr, page_size, topk, T = 128, 512, 64, 64, 2048, 8
    small_pages = 80
    key = jax.random.key(1)
    latent = jax.random.normal(key, (small_pages, page_size, dl + dr), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 1), (T, heads, dl + dr), jnp.bfloat16)
    rows = np.stack([np.random.default_rng(t).permutation(small_pages * page_size)[:topk] for t in range(T)])
    rows[1, 100:] = -1
    kw = dict(scale=0.07, kv_lora_rank=dl, impl="pallas")
    want = sparse_mla_attention(q, latent, jnp.asarray(rows, jnp.int32), **kw)
    big_pages = pages_past_int32(page_size * (dl + dr), small_pages)
    shift = (big_pages - small_pages) * page_size
    big_rows = jnp.asarray(np.where(rows >= 0, rows + shift, -1), jnp.int32)
    got = sparse_mla_attention(q, at_top(latent, big_pages), big_rows, **kw)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_indexer_reads_fp8_keys_past_2_31_elements():
    """Past 2^31 elements the logits kernel takes the FP8 keys as byte pairs (32-bit offsets of a 1-byte array
    overflow there, see `_dispatch.MAX_BYTE_ELEMENTS`); the small pool is read as pairs too, so that both sum alike."""
    index_heads, dim, page_size, topk, T = 64, 128, 64, 2048, 4
    small_pages = 1 + 2 * 64  # two sequences of 64 pages (4096 keys) each
    key = jax.random.key(2)
    k8, k_scale = quantize_index_k_fp8(jax.random.normal(key, (small_pages, page_size, dim), jnp.float32))
    q = jax.random.normal(jax.random.fold_in(key, 1), (T, index_heads, dim), jnp.bfloat16)
    weights = jax.random.normal(jax.random.fold_in(key, 2), (T, index_heads), jnp.float32)
    table = np.arange(1, small_pages, dtype=np.int32).reshape(2, 64)
    meta = dict(kv_lens=jnp.array([4096, 3000, 2049, 17], jnp.int32), seq_ids=jnp.array([0, 1, 0, 1], jnp.int32),
                topk=topk)
    want = indexer_topk_pallas(q, weights, k8, k_scale=k_scale, page_table=jnp.asarray(table),
                               logits_options=dict(byte_pairs=True), **meta)
    big_pages = pages_past_int32(page_size * dim, small_pages)
    shift = big_pages - small_pages
    big_keys = at_top(k8, big_pages)
    assert needs_byte_pairs(big_keys)
    got = indexer_topk(q, weights, big_keys, k_scale=at_top(k_scale, big_pages), page_table=jnp.asarray(table + shift),
                       impl="pallas", **meta)
    np.testing.assert_array_equal(np.sort(np.asarray(got), axis=1), np.sort(np.asarray(want), axis=1))
