"""paged_attention: the XLA reference against a float64 per-token oracle built here from scratch, and the Pallas
kernel (interpret mode on CPU) against the reference, on packed batches with NaN planted in every cache row no
query may read."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _dispatch, paged_attention, paged_attention_reference
from tests.bitwise import jit_contracting_fmas

# The package re-exports the function under the module's name, so fetch the module itself.
pa = importlib.import_module("pallas_kernels.paged_attention")


def make_problem(seed, chunks, num_tokens, *, heads, kv_heads, head_dim=16, page_size=16, max_pages=4,
                 dtype=jnp.float32, fill_unwritten=np.nan):
    """A packed batch: sequence s holds the chunk `chunks[s] = (start, length)` (length 0: a padding sequence with an
    all-zero page-table row); tokens past the chunks are padding. Keys and values exist at positions
    0..start+length-1 of each sequence, on distinct random pages >= 1; every other cache row, and all of page 0 (the
    null page), holds `fill_unwritten`."""
    rng = np.random.default_rng(seed)
    lengths = [n for _, n in chunks]
    assert sum(lengths) <= num_tokens
    num_pages = 1 + sum(-(-(start + n) // page_size) for start, n in chunks if n)
    k = np.full((num_pages, page_size, kv_heads, head_dim), fill_unwritten, np.float32)
    v = k.copy()
    free_pages = iter(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(chunks), max_pages), np.int32)
    positions = np.zeros(num_tokens, np.int32)  # padding tokens at position 0, as the engine pads them
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    for s, (start, n) in enumerate(chunks):
        if n == 0:
            continue
        for j in range(start + n):
            if j % page_size == 0:
                page_table[s, j // page_size] = next(free_pages)
            row = (page_table[s, j // page_size], j % page_size)
            k[row] = rng.standard_normal((kv_heads, head_dim))
            v[row] = rng.standard_normal((kv_heads, head_dim))
        positions[cu[s]:cu[s + 1]] = np.arange(start, start + n)
    q = rng.standard_normal((num_tokens, heads, head_dim))
    return dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k, dtype), v_pages=jnp.asarray(v, dtype),
                page_table=jnp.asarray(page_table), cu_seqlens=jnp.asarray(cu), positions=jnp.asarray(positions))


def oracle(p, scale):
    """Each real token over the keys 0..position of its sequence, float64; padding tokens 0."""
    q, k, v = (np.asarray(p[name], np.float64) for name in ("q", "k_pages", "v_pages"))
    page_table, cu, positions = (np.asarray(p[name]) for name in ("page_table", "cu_seqlens", "positions"))
    page_size, group = k.shape[1], q.shape[1] // k.shape[2]
    out = np.zeros_like(q)
    for s in range(len(cu) - 1):
        for t in range(cu[s], cu[s + 1]):
            j = np.arange(positions[t] + 1)
            rows = (page_table[s, j // page_size], j % page_size)
            for h in range(q.shape[1]):
                scores = k[rows][:, h // group] @ q[t, h] * scale
                w = np.exp(scores - scores.max())
                out[t, h] = w @ v[rows][:, h // group] / w.sum()
    return out


def run(p, scale, impl, **options):
    return paged_attention(p["q"], p["k_pages"], p["v_pages"], page_table=p["page_table"],
                           cu_seqlens=p["cu_seqlens"], positions=p["positions"], scale=scale, impl=impl,
                           interpret=impl == "pallas", **options)


def reference(p, scale):
    return paged_attention_reference(p["q"], p["k_pages"], p["v_pages"], page_table=p["page_table"],
                                     cu_seqlens=p["cu_seqlens"], positions=p["positions"], scale=scale)


# A mixed batch: a 7-token prompt (not a multiple of the query block), a 5-token chunk starting at 21 (keys from
# earlier steps, crossing a page), an empty padding sequence, a decode token at position 40, then 3 padding tokens.
MIXED = [(0, 7), (21, 5), (0, 0), (40, 1)]
MIXED_TOKENS = 16
MIXED_REAL = 13  # tokens 13..15 are padding
# GQA with R = H / Hk = 5 query heads per kv head: padded to 8 rows in the kernel.
GQA5 = dict(heads=10, kv_heads=2)


@pytest.mark.parametrize("page_size", [16, 6])
def test_reference_matches_oracle(page_size):
    p = make_problem(0, MIXED, MIXED_TOKENS, **GQA5, page_size=page_size, max_pages=8)
    got = np.asarray(reference(p, 0.5))
    # Both are exact float32 / float64 arithmetic on the same keys: float32 rounding only.
    np.testing.assert_allclose(got, oracle(p, 0.5), rtol=1e-5, atol=1e-6)
    assert np.all(got[MIXED_REAL:] == 0), "padding tokens must get exactly 0"


# Tiles: two tokens x 8 padded heads = 16 rows with 16-key tiles (one page per tile), and 4 x 8 rows with 8-key tiles
# split over 3 programs per block (flash decoding) on 6-row pages (key tiles straddle pages).
KERNEL_CASES = [(16, dict(block_q=2, block_k=16)), (6, dict(block_q=4, block_k=8, num_splits=3))]


@pytest.mark.parametrize("page_size,options", KERNEL_CASES)
def test_kernel_float32_mixed_batch(page_size, options):
    p = make_problem(1, MIXED, MIXED_TOKENS, **GQA5, page_size=page_size, max_pages=8)
    got = np.asarray(run(p, 0.5, "pallas", **options))
    # Exact float32 dots on both sides; the kernel's online softmax only reorders the sums and rescales by
    # exp(m_old - m_new): a few float32 ulps per key tile, far below 1e-5 relative.
    np.testing.assert_allclose(got, np.asarray(reference(p, 0.5)), rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(got)), "NaN in unwritten rows or in the null page reached the output"
    assert np.all(got[MIXED_REAL:] == 0), "padding tokens must get exactly 0"


def test_kernel_bfloat16_mixed_batch():
    p = make_problem(2, MIXED, MIXED_TOKENS, **GQA5, dtype=jnp.bfloat16)
    got = run(p, 0.5, "pallas", block_q=2, block_k=16)
    assert got.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float32), np.asarray(reference(p, 0.5), np.float32)
    # Scores agree to float32 rounding (bf16 x bf16 products are exact in float32). The probabilities are rounded to
    # bf16 (relative 2^-9) on both sides, the reference after normalising, the kernel before: the two value sums
    # differ by at most 2 * 2^-9 * sum_j p_j |v_j| <= 2^-8 max|v|, and each output is rounded to bf16 once more
    # (2^-9 relative on each side).
    v = np.asarray(p["v_pages"], np.float32)
    atol = 2.0 ** -8 * np.nanmax(np.abs(v))
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=atol)
    assert np.all(got[MIXED_REAL:] == 0)


# Decode buckets: one token per sequence, the last two slots padding (empty sequences and padding tokens). GQA
# groups of 5 (2 tokens per block) and of 5 with a single kv head (H = 5 < 8 padded rows: masked rows alias real
# rows of the next token) and of 16 (one token per block); default tiles (with key splits) and forced ones.
DECODE_CASES = [(dict(heads=10, kv_heads=2), dict()), (dict(heads=5, kv_heads=1), dict(num_splits=1, block_k=16)),
                (dict(heads=16, kv_heads=1), dict(num_splits=4, block_k=16))]


@pytest.mark.parametrize("heads,options", DECODE_CASES)
def test_kernel_decode_layout(heads, options):
    chunks = [(0, 1), (16, 1), (39, 1), (3, 1), (0, 0), (0, 0)]
    p = make_problem(3, chunks, len(chunks), **heads, max_pages=4)
    got = np.asarray(run(p, 0.5, "pallas", **options))
    np.testing.assert_allclose(got, np.asarray(reference(p, 0.5)), rtol=1e-5, atol=1e-6)  # as in the float32 test
    assert np.all(got[4:] == 0)


def test_kernel_ignores_unwritten_rows():
    """Changing what the unwritten rows and the null page hold (NaN vs 0) changes no output bit."""
    with_nan = make_problem(4, MIXED, MIXED_TOKENS, **GQA5, fill_unwritten=np.nan)
    with_zero = make_problem(4, MIXED, MIXED_TOKENS, **GQA5, fill_unwritten=0.0)
    options = dict(block_q=2, block_k=16)
    np.testing.assert_array_equal(np.asarray(run(with_nan, 0.5, "pallas", **options)),
                                  np.asarray(run(with_zero, 0.5, "pallas", **options)))


def test_kernel_request_alone_equals_request_in_padded_batch():
    """Query blocks are aligned to sequence starts, so a request's outputs do not depend on its batch mates."""
    batch = make_problem(5, [(21, 5)] + MIXED, MIXED_TOKENS + 5, **GQA5)
    alone = dict(batch, q=batch["q"][:5], page_table=batch["page_table"][:1], cu_seqlens=jnp.array([0, 5], jnp.int32),
                 positions=batch["positions"][:5])
    kernel = jit_contracting_fmas(lambda p: run(p, 0.5, "pallas", block_q=2, block_k=16, num_splits=2))
    np.testing.assert_array_equal(np.asarray(kernel(alone)), np.asarray(kernel(batch))[:5])


def test_default_tiles():
    # Nano-9B (R = 5 -> 8 rows per token): decode fills 16 rows with 2 tokens, a prefill chunk 128 rows with 16.
    assert pa.default_block_q(num_tokens=64, num_seqs=64, heads=40, kv_heads=8) == 2
    assert pa.default_block_q(num_tokens=2048, num_seqs=1, heads=40, kv_heads=8) == 16
    # Nano-30B (R = 16): one token per decode block.
    assert pa.default_block_q(num_tokens=64, num_seqs=64, heads=32, kv_heads=2) == 1
    # One decode sequence over 8k keys: 32 splits of 256 keys for 8 kv heads; 256 sequences need none.
    assert pa.default_num_splits(1, 1, kv_heads=8, max_keys=8192, block_q=2, block_k=64) == 32
    assert pa.default_num_splits(256, 256, kv_heads=8, max_keys=8192, block_q=2, block_k=64) == 1


def test_real_model_shapes_are_supported():
    for heads, kv_heads in [(40, 8), (32, 2)]:  # Nemotron-Nano-9B-v2, Nemotron-3 Nano 30B-A3B
        assert pa.pallas_problem(heads, kv_heads, 128, num_tokens=256, num_seqs=256) is None
        assert pa.pallas_problem(heads, kv_heads, 128, num_tokens=2048, num_seqs=1) is None


def test_unsupported_head_dim_falls_back_or_raises(monkeypatch):
    p = make_problem(6, [(0, 3)], 4, heads=4, kv_heads=2, head_dim=12)
    assert "head_dim=12" in pa.pallas_problem(4, 2, 12)
    with pytest.raises(ValueError, match="head_dim=12"):
        paged_attention(p["q"], p["k_pages"], p["v_pages"], page_table=p["page_table"], cu_seqlens=p["cu_seqlens"],
                        positions=p["positions"], scale=0.3, impl="pallas")
    # As if on a GPU: `auto` must take the reference (the compiled kernel cannot run on this CPU at all).
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    got = paged_attention(p["q"], p["k_pages"], p["v_pages"], page_table=p["page_table"],
                          cu_seqlens=p["cu_seqlens"], positions=p["positions"], scale=0.3, impl="auto")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(reference(p, 0.3)))


# Nano-9B decode with 16 key splits and without, a Nano-9B prefill chunk, Nano-30B decode (one token per block),
# float32 (IEEE dots).
LOWERING_CASES = [(4, 4, 40, 8, jnp.bfloat16), (64, 64, 40, 8, jnp.bfloat16), (2048, 1, 40, 8, jnp.bfloat16),
                  (64, 64, 32, 2, jnp.bfloat16), (4, 4, 40, 8, jnp.float32)]


@pytest.mark.parametrize("num_tokens,num_seqs,heads,kv_heads,dtype", LOWERING_CASES)
def test_kernel_lowers_to_triton(num_tokens, num_seqs, heads, kv_heads, dtype, cuda_lowering):
    """Real model shapes lower to Triton IR (the GPU compile itself is checked by the gpu test and the bench)."""
    S = jax.ShapeDtypeStruct
    cache = S((512, 16, kv_heads, 128), dtype)
    f = jax.jit(lambda q, k, v, pt, cu, pos: paged_attention(q, k, v, page_table=pt, cu_seqlens=cu, positions=pos,
                                                              scale=128 ** -0.5, impl="pallas"))
    cuda_lowering(f, S((num_tokens, heads, 128), dtype), cache, cache, S((num_seqs, 256), jnp.int32),
                  S((num_seqs + 1,), jnp.int32), S((num_tokens,), jnp.int32))


@pytest.mark.gpu
def test_kernel_on_gpu_nano9b_bf16():
    # A 300-token chunk starting at 1000, decodes at long contexts, an empty sequence, 4 padding tokens.
    chunks = [(1000, 300), (2047, 1), (511, 1), (0, 0), (4000, 1)]
    p = make_problem(7, chunks, 307, heads=40, kv_heads=8, head_dim=128, page_size=16, max_pages=256,
                     dtype=jnp.bfloat16)
    want = np.asarray(reference(p, 128 ** -0.5), np.float32)
    atol = 2.0 ** -8 * np.nanmax(np.abs(np.asarray(p["v_pages"], np.float32)))  # as in the bf16 test above
    for options in [dict(), dict(num_splits=8), dict(block_q=4, block_k=32)]:
        got = np.asarray(paged_attention(p["q"], p["k_pages"], p["v_pages"], page_table=p["page_table"],
                                         cu_seqlens=p["cu_seqlens"], positions=p["positions"], scale=128 ** -0.5,
                                         impl="pallas", **options), np.float32)
        assert np.all(got[303:] == 0), options
        np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=atol, err_msg=str(options))
