"""sparse_mla_attention: Pallas kernel (interpret mode) and XLA reference against dense attention masked to the
same indices, built here from scratch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import logical_to_cache_rows, sparse_mla_attention
from tests.numerics import rms_relative_error


def dense_masked_attention(q, latent_cache, indices, scale, dl):
    """Attention of each query over every cache row, with the rows not in its index list masked out (float64)."""
    q = np.asarray(q, np.float64)
    flat = np.asarray(latent_cache, np.float64).reshape(-1, q.shape[-1])
    T, H, _ = q.shape
    out = np.zeros((T, H, dl))
    for t in range(T):
        rows = np.asarray(indices[t])
        mask = np.zeros(flat.shape[0], bool)
        mask[rows[rows >= 0]] = True
        if not mask.any():
            continue
        s = q[t] @ flat.T * scale  # [H, R]
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[t] = p @ flat[:, :dl]
    return out


def _problem(key, T=4, H=4, dl=32, dr=16, num_pages=6, page_size=8, topk=20):
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (T, H, dl + dr), jnp.float32)
    cache = jax.random.normal(k2, (num_pages, page_size, dl + dr), jnp.float32)
    rows = num_pages * page_size
    idx = np.stack([np.asarray(jax.random.permutation(jax.random.fold_in(k3, t), rows))[:topk] for t in range(T)])
    idx[1, 5:] = -1  # fewer keys than topk
    idx[2, :] = -1  # no key at all -> zeros
    idx[3, ::3] = -1  # holes
    return q, cache, jnp.asarray(idx, jnp.int32)


def test_sparse_mla_matches_dense_masked_attention():
    dl, scale = 32, 0.2
    q, cache, idx = _problem(jax.random.key(0), dl=dl)
    want = dense_masked_attention(q, cache, idx, scale, dl)
    ref = sparse_mla_attention(q, cache, idx, scale=scale, kv_lora_rank=dl, impl="xla")
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5)
    # block_k=8 over topk=20: the kernel pads the index list to 24 with -1.
    got = sparse_mla_attention(q, cache, idx, scale=scale, kv_lora_rank=dl, impl="pallas", interpret=True,
                               block_h=2, block_k=8)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[2] == 0)


@pytest.mark.parametrize("num_splits,trim", [(2, True), (4, True), (3, False), (1, True)])
def test_split_decode_matches_dense_masked_attention(num_splits, trim):
    """The top-k list split over programs (flash-decoding), partial softmax states combined after: splits past a
    row's last key are empty (row 1), a row with no key gives zeros (row 2), holes (row 3); topk 20 is not a
    multiple of the splits' lengths (8 with trimming, a power of two; 8 then 8 then 8 without)."""
    dl, scale = 32, 0.2
    q, cache, idx = _problem(jax.random.key(4), dl=dl)
    want = dense_masked_attention(q, cache, idx, scale, dl)
    got = sparse_mla_attention(q, cache, idx, scale=scale, kv_lora_rank=dl, impl="pallas", interpret=True,
                               block_h=2, block_k=4, num_splits=num_splits, trim=trim)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[2] == 0)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_listed_counts_bound_the_walk(num_splits):
    """Lists laid out as the indexer lays them (keys first, then −1) with their counts: the kernel walks only the
    chunks holding keys and gives dense attention over them. A count past the keys (row 3: an upper bound) is fine."""
    dl, scale = 32, 0.2
    q, cache, _ = _problem(jax.random.key(6), dl=dl)
    counts = np.array([40, 13, 0, 27])
    rows = np.stack([np.random.default_rng(t).permutation(cache.shape[0] * cache.shape[1])[:40] for t in range(4)])
    idx = np.where(np.arange(40)[None, :] < counts[:, None], rows, -1).astype(np.int32)
    idx[3, 20:] = -1  # 20 keys, a count of 27
    want = dense_masked_attention(q, cache, idx, scale, dl)
    got = sparse_mla_attention(q, cache, jnp.asarray(idx), scale=scale, kv_lora_rank=dl, listed=jnp.asarray(counts),
                               impl="pallas", interpret=True, block_h=2, block_k=4, num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[2] == 0)


def test_split_decode_bf16_keeps_float32_partials():
    """bf16 in and out; the partial states are float32, so splitting adds no rounding beyond one split's."""
    dl, scale = 32, 0.15
    q, cache, idx = _problem(jax.random.key(5), dl=dl, topk=40)
    qb, cb = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    want = dense_masked_attention(qb.astype(jnp.float32), cb.astype(jnp.float32), idx, scale, dl)
    got = sparse_mla_attention(qb, cb, idx, scale=scale, kv_lora_rank=dl, impl="pallas", interpret=True,
                               block_h=4, block_k=4, num_splits=4)
    assert got.dtype == jnp.bfloat16
    # P is rounded to bf16 before P @ V (as on the tensor cores): bf16-level error, as in test_sparse_mla_bf16.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def test_decode_splits_follow_the_batch():
    """Small decode batches split the top-k list to fill the GPU; large ones and prefill chunks do not."""
    from pallas_kernels.sparse_mla_attention import MIN_KEYS_PER_SPLIT, decode_splits

    one = decode_splits(1, heads=128, topk=2048, block_h=32)
    assert one == 2048 // MIN_KEYS_PER_SPLIT
    assert 1 < decode_splits(32, heads=128, topk=2048, block_h=32) < one
    assert decode_splits(128, heads=128, topk=2048, block_h=32) == 1
    assert decode_splits(1, heads=128, topk=64, block_h=32) == 1  # a list too short to split


def test_sparse_mla_bf16():
    dl, scale = 32, 0.15
    q, cache, idx = _problem(jax.random.key(1), dl=dl)
    qb, cb = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    want = dense_masked_attention(qb.astype(jnp.float32), cb.astype(jnp.float32), idx, scale, dl)
    got = sparse_mla_attention(qb, cb, idx, scale=scale, kv_lora_rank=dl, impl="pallas", interpret=True,
                               block_h=4, block_k=4)
    assert got.dtype == jnp.bfloat16
    # P is rounded to bf16 before P @ V (as on the tensor cores): bf16-level error.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def test_logical_to_cache_rows():
    page_table = jnp.array([[3, 1, 4], [2, 5, 0]], jnp.int32)
    idx = jnp.array([[0, 9, 17, -1], [7, 8, -1, 23]], jnp.int32)
    rows = logical_to_cache_rows(idx, page_table, jnp.array([0, 1], jnp.int32), page_size=8)
    np.testing.assert_array_equal(np.asarray(rows), [[24, 9, 33, -1], [23, 40, -1, 7]])


def test_sparse_mla_lowers_to_triton(cuda_lowering):
    S = jax.ShapeDtypeStruct
    for options in [dict(), dict(num_splits=8), dict(num_splits=4, block_h=64, num_warps=8, num_stages=2),
                    dict(num_splits=1, trim=False, block_k=64, num_stages=3)]:
        cuda_lowering(jax.jit(lambda q, c, i: sparse_mla_attention(q, c, i, scale=0.1, impl="pallas", **options)),
                      S((8, 128, 576), jnp.bfloat16), S((64, 64, 576), jnp.bfloat16), S((8, 2048), jnp.int32))
    cuda_lowering(jax.jit(lambda q, c, i, n: sparse_mla_attention(q, c, i, scale=0.1, listed=n, impl="pallas")),
                  S((8, 128, 576), jnp.bfloat16), S((64, 64, 576), jnp.bfloat16), S((8, 2048), jnp.int32),
                  S((8,), jnp.int32))


@pytest.mark.gpu
def test_sparse_mla_on_gpu():
    q, cache, idx = _problem(jax.random.key(2), T=4, H=128, dl=512, dr=64, num_pages=64, page_size=64, topk=2048)
    qb, cb = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    want = dense_masked_attention(qb.astype(jnp.float32), cb.astype(jnp.float32), idx, 0.04, 512)
    got = sparse_mla_attention(qb, cb, idx, scale=0.04, impl="pallas")
    assert rms_relative_error(got, want) < 2e-2


def test_prefill_tiles_only_for_16_bit_chunks():
    """The large prefill tiles need 216 KiB of shared memory in 16-bit; float32 chunks and decode keep the small."""
    from pallas_kernels.sparse_mla_attention import PREFILL_MIN_QUERIES, PREFILL_TILES, default_tiles

    assert default_tiles(PREFILL_MIN_QUERIES, jnp.bfloat16, heads=128, topk=2048) == PREFILL_TILES
    assert default_tiles(PREFILL_MIN_QUERIES, jnp.float32, heads=128, topk=2048)["block_k"] == 32
    assert default_tiles(PREFILL_MIN_QUERIES - 1, jnp.bfloat16, heads=128, topk=2048)["block_k"] == 32


def test_prefill_tiles_match_reference_in_interpret_mode():
    """A chunk long enough for the prefill tiles (64-row gathers over a top-k that is not a multiple of 64)."""
    from pallas_kernels.sparse_mla_attention import PREFILL_MIN_QUERIES

    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    T, H, dl, dr, rows, topk = PREFILL_MIN_QUERIES, 2, 32, 16, 256, 80
    q = jax.random.normal(k1, (T, H, dl + dr)).astype(jnp.bfloat16)
    cache = jax.random.normal(k2, (rows // 16, 16, dl + dr)).astype(jnp.bfloat16)
    idx = jax.random.randint(k3, (T, topk), -1, rows).astype(jnp.int32)
    want = sparse_mla_attention(q, cache, idx, scale=0.2, kv_lora_rank=dl, impl="xla")
    got = sparse_mla_attention(q, cache, idx, scale=0.2, kv_lora_rank=dl, impl="pallas", interpret=True)
    # bf16 inputs and output, P rounded to bf16 before P @ V: bf16-level error, as in test_sparse_mla_bf16.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
