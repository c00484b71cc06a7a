"""indexer_topk: the Pallas kernels (interpret mode on CPU) against the XLA reference, plus a Triton lowering check.

Top-k results are compared as sets with tie handling: every selected key must score at least the k-th best
reference score (minus `tol`), every key scoring above it (plus `tol`) must be selected, no duplicates, −1 only
after the valid entries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer_topk, quantize_index_k_fp8
from pallas_kernels.indexer_topk import (index_logits_pallas, index_logits_reference, indexer_topk_pallas,
                                         topk_reference)
from pallas_kernels.topk_select import (GROUP, count_ge, kth_largest_key, masked_keys_and_group_max,
                                       select_topk_pallas)


def assert_topk_valid(idx, scores, kv_lens, topk, tol=0.0):
    """idx[T, topk] against reference scores[T, N] (only the first kv_lens[t] entries are valid)."""
    idx, scores, kv_lens = np.asarray(idx), np.asarray(scores, np.float64), np.asarray(kv_lens)
    T, N = scores.shape
    assert idx.shape == (T, topk) and idx.dtype == np.int32
    for t in range(T):
        n_valid = min(int(kv_lens[t]), N)
        k_eff = min(topk, n_valid)
        row = idx[t]
        assert (row[k_eff:] == -1).all(), f"row {t}: entries past {k_eff} must be -1: {row}"
        sel = row[:k_eff]
        assert ((sel >= 0) & (sel < n_valid)).all(), f"row {t}: out of range {sel}"
        assert len(set(sel.tolist())) == k_eff, f"row {t}: duplicates"
        if k_eff == 0:
            continue
        valid = scores[t, :n_valid]
        kth = np.sort(valid)[::-1][k_eff - 1]
        assert (valid[sel] >= kth - tol).all(), f"row {t}: selected a key below the k-th score"
        must = np.nonzero(valid > kth + tol)[0]
        assert set(must.tolist()) <= set(sel.tolist()), f"row {t}: missed a key above the k-th score"


def _kth_largest_numpy(keys, k):
    return np.sort(keys)[::-1][k - 1]


@pytest.mark.parametrize("digit_bits", [1, 2, 4])
def test_kth_largest_key_digit_search(digit_bits):
    """The digit search against a sort, on keys spread over the whole int32 range (both signs, the extremes)."""
    rng = np.random.default_rng(digit_bits)
    keys = rng.integers(-(2**31) + 1, 2**31 - 1, size=256, dtype=np.int64).astype(np.int32)
    keys[:4] = [-(2**31) + 1, 2**31 - 2, -1, 0]
    keys[4:12] = keys[20]  # a tie
    search = jax.jit(lambda k, stop_at: kth_largest_key(lambda thr: count_ge(jnp.asarray(keys), thr), k,
                                                         digit_bits=digit_bits, stop_at=stop_at),
                     static_argnums=1)
    for k in [1, 5, 37, 200, 256]:
        kth = _kth_largest_numpy(keys, k)
        assert int(search(k, None)) == kth
        # Stopping once exactly k keys are >= t: t may sit below the k-th key, but cuts off the same k keys.
        t = int(search(k, k))
        assert t <= kth and (keys >= t).sum() == (keys >= kth).sum()
        # A bound: at least k and at most stop_at keys >= t (here no ties straddle it).
        bound = int(search(k, k + 30))
        assert k <= (keys >= bound).sum() <= max(k + 30, (keys >= kth).sum())


def test_kth_largest_key_with_fewer_keys_than_k():
    """Fewer than k keys above INT_MIN (invalid positions): the bound is INT_MIN + 1, i.e. every valid key."""
    keys = jnp.array([5, -(2**31), -(2**31), 7], jnp.int32)
    t = kth_largest_key(lambda thr: count_ge(keys, thr), 3, digit_bits=2)
    assert int(t) == -(2**31) + 1


SELECT_VARIANTS = [dict(), dict(gmax_in_registers=0), dict(digit_bits=4), dict(digit_bits=2, gmax_in_registers=0),
                   dict(compaction="row"), dict(compaction="row", digit_bits=4), dict(early_stop=False),
                   dict(compact_lanes=8)]


@pytest.mark.parametrize("options", SELECT_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_select_topk_matches_reference(options):
    N, topk = 128, 8
    x = jax.random.normal(jax.random.key(1), (7, N), jnp.float32)
    # Rows 7..13 have few distinct values: ties at the bound put more than next_pow2(k) groups above it, so those
    # rows take the whole-row fallback.
    x = jnp.concatenate([x, jnp.round(x * 0.7)])
    kv_lens = jnp.array([128, 1, 0, 5, 8, 9, 100] * 2, jnp.int32)  # full, length 1, empty, shorter than k, = k, ...
    got = select_topk_pallas(x, kv_lens, topk, chunk=32, interpret=True, **options)
    masked = jnp.where(jnp.arange(N) < kv_lens[:, None], x, -jnp.inf)
    ref = topk_reference(masked, kv_lens, topk)
    assert_topk_valid(got, masked, kv_lens, topk)
    assert_topk_valid(ref, masked, kv_lens, topk)
    # Ties keep the lowest positions, like lax.top_k, so even the tied rows match exactly as sets.
    for t in range(x.shape[0]):
        assert set(np.asarray(got[t]).tolist()) == set(np.asarray(ref[t]).tolist())


@pytest.mark.parametrize("gmax_in_registers", [16384, 0])
def test_select_topk_with_given_group_maxima(gmax_in_registers):
    """Group maxima handed in (as the logits kernel writes them) select the same keys as the kernel's own pass."""
    T, N, topk, group = 5, 256, 8, 4
    x = jax.random.normal(jax.random.key(9), (T, N), jnp.float32)
    kv_lens = jnp.array([256, 200, 33, 31, 0], jnp.int32)
    pos = jnp.arange(N, dtype=jnp.int32)
    gmax = jax.vmap(lambda row, n: masked_keys_and_group_max(row, pos, n, group)[1])(x, kv_lens)
    got = select_topk_pallas(x, kv_lens, topk, gmax=gmax, chunk=64, gmax_in_registers=gmax_in_registers,
                             interpret=True)
    ref = topk_reference(jnp.where(pos < kv_lens[:, None], x, -jnp.inf), kv_lens, topk)
    for t in range(T):
        assert set(np.asarray(got[t]).tolist()) == set(np.asarray(ref[t]).tolist())


def test_select_topk_k_larger_than_the_row():
    """topk > N: every valid key, then −1 (the candidate buffer is wider than the row)."""
    T, N, topk = 3, 32, 40
    x = jax.random.normal(jax.random.key(10), (T, N))
    kv_lens = jnp.array([32, 17, 0], jnp.int32)
    got = select_topk_pallas(x, kv_lens, topk, interpret=True)
    masked = jnp.where(jnp.arange(N) < kv_lens[:, None], x, -jnp.inf)
    assert_topk_valid(got, masked, kv_lens, topk)


def _paged_problem(key, *, T, Hi, D, page_size, max_pages, num_pages, dtype=jnp.float32):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    q = jax.random.normal(k1, (T, Hi, D), jnp.float32).astype(dtype)
    w = jax.random.normal(k2, (T, Hi), jnp.float32) * (Hi * D) ** -0.5
    k_cache = jax.random.normal(k3, (num_pages, page_size, D), jnp.float32).astype(dtype)
    # Two sequences with shuffled, disjoint pages; page 0 is the null page.
    perm = np.asarray(jax.random.permutation(k4, np.arange(1, num_pages)))
    page_table = jnp.asarray(perm[: 2 * max_pages].reshape(2, max_pages), jnp.int32)
    return q, w, k_cache, page_table


def _fp8_five_queries(key, *, Hi, max_pages, num_pages, kv_lens):
    """Five queries of two sequences over FP8 keys (D = 32, pages of 8): (q, w, k8, the kernels' keyword args)."""
    q, w, k_cache, page_table = _paged_problem(key, T=5, Hi=Hi, D=32, page_size=8, max_pages=max_pages,
                                               num_pages=num_pages, dtype=jnp.bfloat16)
    k8, k_scale = quantize_index_k_fp8(k_cache)
    return q, w, k8, dict(kv_lens=jnp.array(kv_lens, jnp.int32), page_table=page_table,
                          seq_ids=jnp.array([0, 1, 1, 0, 1], jnp.int32), k_scale=k_scale)


def test_indexer_topk_paged_prefill_and_decode():
    Hi, D, page_size, max_pages, topk = 4, 16, 8, 6, 16
    T = 13
    q, w, k_cache, page_table = _paged_problem(jax.random.key(3), T=T, Hi=Hi, D=D, page_size=page_size,
                                               max_pages=max_pages, num_pages=16)
    # Packed batch: seq 0 prefill chunk at positions 20..27, seq 1 at positions 0..3, then a decode query of
    # seq 1 over 45 keys (and its padding token with kv_len 0). Query blocks of 4 straddle the two sequences.
    seq_ids = jnp.array([0] * 8 + [1] * 4 + [1], jnp.int32)
    kv_lens = jnp.array([21 + i for i in range(8)] + [1, 2, 3, 4] + [45], jnp.int32)
    kv_lens = kv_lens.at[12].set(0).at[11].set(45)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids)
    ref_logits = index_logits_reference(q, w, k_cache, **kw)
    got_logits = index_logits_pallas(q, w, k_cache, block_q=4, block_kv=16, interpret=True, **kw)[:T]
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    got = indexer_topk(q, w, k_cache, topk=topk, impl="pallas", interpret=True, **kw)
    ref = indexer_topk(q, w, k_cache, topk=topk, impl="xla", **kw)
    assert_topk_valid(got, ref_logits, kv_lens, topk, tol=1e-5)
    assert_topk_valid(ref, ref_logits, kv_lens, topk)


# On a GPU, interpret mode is compiled by XLA, which may compute a logits row twice (for the stored logits and for
# the group maxima) with different multiply-add contraction: 1-2 float32 ulps apart (seen on the H200 with several key
# tiles a program). The compiled kernel computes it once: test_compiled_logits_fuse_exact_group_maxima_on_gpu.
@pytest.mark.cpu_only
@pytest.mark.parametrize("tiles_per_program, block_q", [(2, 1), (4, 1), (2, 4)])
def test_logits_with_several_key_tiles_per_program(tiles_per_program, block_q):
    """A program scoring several key tiles with its queries loaded once: rows ending inside a program's span (its
    later tiles masked) and programs wholly past every row, FP8 keys."""
    q, w, k8, kw = _fp8_five_queries(jax.random.key(14), Hi=4, max_pages=16, num_pages=40, kv_lens=[128, 70, 9, 33, 0])
    want = index_logits_reference(q, w, k8, **kw)
    got, gmax = index_logits_pallas(q, w, k8, block_kv=16, tiles_per_program=tiles_per_program, block_q=block_q,
                                    group_max=4, interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got[:5]), np.asarray(want), rtol=1e-4, atol=1e-4)
    pos = jnp.arange(got.shape[1], dtype=jnp.int32)
    lens = jnp.pad(kw["kv_lens"], (0, got.shape[0] - 5))
    want_gmax = jax.vmap(lambda row, n: masked_keys_and_group_max(row, pos, n, 4)[1])(got, lens)
    np.testing.assert_array_equal(np.asarray(gmax), np.asarray(want_gmax))


@pytest.mark.parametrize("tiles_per_program", [1, 2])
def test_fp8_keys_as_byte_pairs_score_as_the_reference(tiles_per_program):
    """FP8 keys taken as uint16 channel pairs (what a pool past 2^31 elements needs, forced here on a small one): the
    even and the odd channels' dots sum to the reference's logits; the selection follows."""
    q, w, k8, kw = _fp8_five_queries(jax.random.key(16), Hi=16, max_pages=8, num_pages=20, kv_lens=[64, 50, 9, 33, 0])
    want = index_logits_reference(q, w, k8, **kw)
    got = index_logits_pallas(q, w, k8, block_kv=16, tiles_per_program=tiles_per_program, byte_pairs=True,
                              interpret=True, **kw)
    np.testing.assert_allclose(np.asarray(got[:5]), np.asarray(want), rtol=1e-4, atol=1e-4)
    picked = indexer_topk_pallas(q, w, k8, topk=8, chunk=16, logits_options=dict(byte_pairs=True), interpret=True,
                                 **kw)
    assert_topk_valid(picked, want, kw["kv_lens"], 8, tol=1e-4)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_k_covering_the_whole_row_selects_every_visible_key_in_order(impl):
    """topk >= the keys a row of the table holds (6 pages of 8): every visible key, listed first and in order, which
    the sparse attention's `listed` counts rely on; no logits are computed for it."""
    q, w, k_cache, page_table = _paged_problem(jax.random.key(9), T=3, Hi=4, D=16, page_size=8, max_pages=6,
                                               num_pages=16)
    kv_lens = jnp.array([48, 5, 0], jnp.int32)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=jnp.array([0, 1, 1], jnp.int32))
    got = np.asarray(indexer_topk(q, w, k_cache, topk=48, impl=impl, interpret=True, **kw))
    want = np.where(np.arange(48)[None, :] < np.asarray(kv_lens)[:, None], np.arange(48)[None, :], -1)
    np.testing.assert_array_equal(got, want)
    assert_topk_valid(got, index_logits_reference(q, w, k_cache, **kw), kv_lens, 48)


@pytest.mark.cpu_only  # the group maxima of interpret mode, see above
@pytest.mark.parametrize("fuse_group_max", [True, False])
def test_indexer_topk_long_rows_with_fused_group_maxima(fuse_group_max):
    """Rows longer than 4·next_pow2(k) go through the group-maxima bound, taken from the logits kernel (fused) or
    from the select's own pass; kv_lens not a multiple of the key tile nor of a page."""
    Hi, D, page_size, max_pages, topk, T = 4, 16, 8, 8, 4, 6
    q, w, k_cache, page_table = _paged_problem(jax.random.key(11), T=T, Hi=Hi, D=D, page_size=page_size,
                                               max_pages=max_pages, num_pages=17)
    seq_ids = jnp.array([0, 0, 1, 1, 1, 0], jnp.int32)
    kv_lens = jnp.array([64, 37, 17, 16, 0, 3], jnp.int32)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids)
    ref_logits = index_logits_reference(q, w, k_cache, **kw)
    logits, gmax = index_logits_pallas(q, w, k_cache, block_kv=16, group_max=4, interpret=True, **kw)
    pos = jnp.arange(logits.shape[1], dtype=jnp.int32)
    want_gmax = jax.vmap(lambda row, n: masked_keys_and_group_max(row, pos, n, 4)[1])(logits, kv_lens)
    np.testing.assert_array_equal(np.asarray(gmax), np.asarray(want_gmax))
    got = indexer_topk_pallas(q, w, k_cache, topk=topk, chunk=16, fuse_group_max=fuse_group_max, interpret=True,
                              **kw)
    assert_topk_valid(got, ref_logits, kv_lens, topk, tol=1e-5)


def test_segmented_selection_keeps_the_lowest_positions_among_ties():
    """The split selection (segments' top-k, then the top-k of their candidates) picks exactly what lax.top_k does,
    ties at the k-th score included (8 distinct scores over 256 keys), for rows over every segment, rows ending
    inside one, rows with fewer keys than k (the visible prefix) and empty rows."""
    from pallas_kernels.indexer_topk import select_topk_in_segments

    rows, n, topk = 4, 256, 16
    logits = jax.random.randint(jax.random.key(12), (rows, n), 0, 8).astype(jnp.float32)
    kv_lens = jnp.array([256, 200, 3, 0], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    gmax = jax.vmap(lambda row, m: masked_keys_and_group_max(row, pos, m, 4)[1])(logits, kv_lens)
    got = np.asarray(select_topk_in_segments(logits, gmax, kv_lens, topk, segments=4, chunk=64, interpret=True))
    want = np.asarray(topk_reference(jnp.where(pos[None, :] < kv_lens[:, None], logits, -jnp.inf), kv_lens, topk))
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
    np.testing.assert_array_equal(got[2], [0, 1, 2] + [-1] * 13)  # listed first, in order


def test_split_and_whole_row_selections_agree():
    """indexer_topk_pallas with and without the split selection on a paged decode batch (few rows, long rows)."""
    q, w, k_cache, page_table = _paged_problem(jax.random.key(13), T=3, Hi=4, D=16, page_size=8, max_pages=16,
                                               num_pages=40)
    kw = dict(kv_lens=jnp.array([128, 77, 9], jnp.int32), page_table=page_table,
              seq_ids=jnp.array([0, 1, 1], jnp.int32))
    from pallas_kernels.indexer_topk import select_segments

    assert select_segments(3, 128, 8) == (4, 32)
    split = indexer_topk_pallas(q, w, k_cache, topk=8, chunk=32, split=True, interpret=True, **kw)
    whole = indexer_topk_pallas(q, w, k_cache, topk=8, chunk=32, split=False, interpret=True, **kw)
    np.testing.assert_array_equal(np.sort(np.asarray(split), axis=1), np.sort(np.asarray(whole), axis=1))
    assert_topk_valid(split, index_logits_reference(q, w, k_cache, **kw), kw["kv_lens"], 8, tol=1e-5)


def test_segments_only_for_few_long_rows():
    from pallas_kernels.indexer_topk import select_segments

    assert select_segments(16, 131136, 2048) == (9, 16384)  # a 128k decode batch: 144 programs, not 16
    assert select_segments(1, 131072, 2048) == (16, 8192)
    assert select_segments(128, 131072, 2048) is None  # enough rows already
    assert select_segments(16, 8192, 2048) is None  # too short to split


def test_indexer_topk_contiguous_bf16():
    S, L, Hi, D, topk = 2, 64, 4, 16, 8
    key = jax.random.key(4)
    q = jax.random.normal(key, (5, Hi, D)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(5), (5, Hi))
    k_cache = jax.random.normal(jax.random.key(6), (S, L, D)).astype(jnp.bfloat16)
    seq_ids = jnp.array([0, 1, 1, 0, 1], jnp.int32)
    kv_lens = jnp.array([64, 7, 1, 33, 60], jnp.int32)
    got = indexer_topk(q, w, k_cache, kv_lens=kv_lens, seq_ids=seq_ids, topk=topk, impl="pallas", interpret=True)
    logits = index_logits_reference(q, w, k_cache, kv_lens=kv_lens, seq_ids=seq_ids)
    # bf16 inputs, float32 products on both sides: only summation order differs.
    assert_topk_valid(got, logits, kv_lens, topk, tol=1e-3)


def test_indexer_topk_fp8_cache():
    Hi, D, page_size, max_pages, topk, T = 4, 32, 8, 4, 8, 6
    q, w, k_cache, page_table = _paged_problem(jax.random.key(7), T=T, Hi=Hi, D=D, page_size=page_size,
                                               max_pages=max_pages, num_pages=12)
    q = q.astype(jnp.bfloat16)
    k8, k_scale = quantize_index_k_fp8(k_cache)
    seq_ids = jnp.array([0, 0, 1, 1, 1, 0], jnp.int32)
    kv_lens = jnp.array([32, 5, 32, 17, 9, 1], jnp.int32)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids)
    # The kernel on FP8 keys equals the reference on the same dequantised keys (exact up to summation order)...
    ref8 = index_logits_reference(q, w, k8, k_scale=k_scale, **kw)
    got8 = index_logits_pallas(q, w, k8, k_scale=k_scale, interpret=True, **kw)[:T]
    np.testing.assert_allclose(np.asarray(got8), np.asarray(ref8), rtol=1e-4, atol=1e-4)
    got = indexer_topk(q, w, k8, k_scale=k_scale, topk=topk, impl="pallas", interpret=True, **kw)
    assert_topk_valid(got, ref8, kv_lens, topk, tol=1e-4)
    # ...and stays within the stated FP8 tolerance of the bf16 scores: |error| <= 5% of the row's score range
    # (e4m3 keeps 3 mantissa bits: relative key error <= 2^-4).
    exact = index_logits_reference(q, w, k_cache.astype(jnp.bfloat16), **kw)
    valid = np.isfinite(np.asarray(exact))
    err = np.abs(np.asarray(ref8)[valid] - np.asarray(exact)[valid])
    scale = np.max(np.abs(np.asarray(exact)[valid]))
    assert err.max() <= 0.05 * scale
    assert_topk_valid(got, exact, kv_lens, topk, tol=0.1 * scale)


def test_kernels_lower_to_triton_at_deepseek_shapes(cuda_lowering):
    """Lowering to the GPU's Triton IR without a GPU catches unsupported primitives and block shapes on CPU."""
    S = jax.ShapeDtypeStruct
    for options in SELECT_VARIANTS:
        cuda_lowering(jax.jit(lambda x, n: select_topk_pallas(x, n, 2048, **options)), S((4, 65536), jnp.float32),
                      S((4,), jnp.int32))
    # 128k-key decode rows: the long-row tiles (group maxima in registers over 16 warps), maxima handed in.
    cuda_lowering(jax.jit(lambda x, g, n: select_topk_pallas(x, n, 2048, gmax=g)), S((1, 131072), jnp.float32),
                  S((1, 32768), jnp.int32), S((1,), jnp.int32))
    for fuse in [True, False]:
        cuda_lowering(jax.jit(
            lambda q, w, k, ks, pt, s, n: indexer_topk_pallas(q, w, k, k_scale=ks, kv_lens=n, page_table=pt,
                                                               seq_ids=s, topk=2048, fuse_group_max=fuse)),
            S((64, 64, 128), jnp.bfloat16), S((64, 64), jnp.float32), S((512, 64, 128), jnp.float8_e4m3fn),
            S((512, 64), jnp.float32), S((2, 256), jnp.int32), S((64,), jnp.int32), S((64,), jnp.int32))
    # A decode batch of 16 rows over 131,136 keys: the split selection (9 segments of 16,384, then the candidates),
    # with one key tile per logits program and with eight, and the keys as byte pairs (a pool past 2^31 elements).
    for logits_options in [None, dict(tiles_per_program=8), dict(byte_pairs=True)]:
        cuda_lowering(jax.jit(
            lambda q, w, k, ks, pt, s, n: indexer_topk_pallas(q, w, k, k_scale=ks, kv_lens=n, page_table=pt,
                                                               seq_ids=s, topk=2048, logits_options=logits_options)),
            S((16, 64, 128), jnp.bfloat16), S((16, 64), jnp.float32), S((4096, 64, 128), jnp.float8_e4m3fn),
            S((4096, 64), jnp.float32), S((16, 2049), jnp.int32), S((16,), jnp.int32), S((16,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_logits_fuse_exact_group_maxima_on_gpu(fp8):
    """The compiled logits kernel at decode (one query a program, by default 4 key tiles each), bf16 or FP8 keys: the
    group maxima it returns are those of the logits it stores, bit for bit, which the select's bound needs; rows
    ending mid-tile, one empty."""
    Hi, D, page_size, max_pages, T = 64, 128, 64, 64, 16
    q, w, k_cache, page_table = _paged_problem(jax.random.key(15), T=T, Hi=Hi, D=D, page_size=page_size,
                                               max_pages=max_pages, num_pages=2 * max_pages + 1, dtype=jnp.bfloat16)
    k_scale = None
    if fp8:
        k_cache, k_scale = quantize_index_k_fp8(k_cache)
    kv_lens = jnp.array([4096 - 250 * i for i in range(T - 1)] + [0], jnp.int32)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=jnp.array([0] * 8 + [1] * 8, jnp.int32),
              k_scale=k_scale)
    logits, gmax = jax.jit(lambda q, w, k: index_logits_pallas(q, w, k, group_max=GROUP, **kw))(q, w, k_cache)
    want = index_logits_reference(q, w, k_cache, **kw)
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_array_equal(np.isfinite(np.asarray(logits[:T])), finite)
    tol = 1e-4 * float(np.abs(np.asarray(want)[finite]).max())
    np.testing.assert_allclose(np.asarray(logits[:T])[finite], np.asarray(want)[finite], rtol=0, atol=tol)
    pos = jnp.arange(logits.shape[1], dtype=jnp.int32)
    want_gmax = jax.vmap(lambda row, n: masked_keys_and_group_max(row, pos, n, GROUP)[1])(logits[:T], kv_lens)
    np.testing.assert_array_equal(np.asarray(gmax[:T]), np.asarray(want_gmax))


@pytest.mark.gpu
def test_indexer_topk_on_gpu():
    """The compiled (Triton) kernels on DeepSeek shapes; bench/dsa_kernels.py --check runs the same on the H200."""
    Hi, D, page_size, max_pages, topk, T = 64, 128, 64, 64, 2048, 16
    q, w, k_cache, page_table = _paged_problem(jax.random.key(8), T=T, Hi=Hi, D=D, page_size=page_size,
                                               max_pages=max_pages, num_pages=2 * max_pages + 1,
                                               dtype=jnp.bfloat16)
    seq_ids = jnp.array([0] * 8 + [1] * 8, jnp.int32)
    kv_lens = jnp.array([4096 - i * 300 for i in range(8)] + [1, 5, 2048, 2049, 3000, 4096, 100, 0], jnp.int32)
    kw = dict(kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids)
    logits = index_logits_reference(q, w, k_cache, **kw)
    got = indexer_topk(q, w, k_cache, topk=topk, impl="pallas", **kw)
    tol = 1e-4 * float(jnp.max(jnp.where(jnp.isfinite(logits), jnp.abs(logits), 0)))
    assert_topk_valid(got, logits, kv_lens, topk, tol=tol)
