"""ssd_chunk_scan: XLA reference and Pallas kernel (interpret mode on CPU) against a float64 per-token recurrence."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mamba_ssd import ssd_chunk_scan, ssd_chunk_scan_pooled
from pallas_kernels._mamba_tiles import head_dim_tiles
from pallas_kernels.mamba_ssd_pallas import _default_segment_len, ssd_chunk_scan_pallas
from tests.numerics import rms_relative_error

IMPLS = ["xla", "pallas"]


def naive_scan(x, dt, A, B, C, D, dt_bias, cu, init, dt_limit=None):
    """Token-by-token Mamba2 recurrence in float64, one sequence at a time."""
    x, dt, A, B, C, D, dt_bias = [np.asarray(a, np.float64) for a in (x, dt, A, B, C, D, dt_bias)]
    T, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    S = len(cu) - 1
    d = np.logaddexp(dt + dt_bias, 0.0)
    if dt_limit is not None:
        d = np.clip(d, *dt_limit)
    y = np.zeros_like(x)
    fin = np.zeros((S, H, P, N))
    g = np.arange(H) // R
    for s in range(S):
        h = np.zeros((H, P, N)) if init is None else np.asarray(init[s], np.float64).copy()
        for t in range(cu[s], cu[s + 1]):
            h = np.exp(d[t] * A)[:, None, None] * h + (d[t][:, None] * x[t])[:, :, None] * B[t, g][:, None, :]
            y[t] = np.einsum("hpn,hn->hp", h, C[t, g]) + D[:, None] * x[t]
        fin[s] = h
    return y, fin


def make_inputs(rng, T, H, P, G, N, S, dtype=np.float32, with_init=True):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    x = f(T, H, P)
    dt = f(T, H) - 1.0
    A = -np.exp(rng.uniform(-2.0, 1.0, H)).astype(np.float32)
    B, C = f(T, G, N), f(T, G, N)
    D, dt_bias = f(H), f(H)
    init = f(S, H, P, N) if with_init else None
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    return dict(x=cast(x), dt=cast(dt), A=jnp.asarray(A), B=cast(B), C=cast(C), D=jnp.asarray(D),
                dt_bias=jnp.asarray(dt_bias), init=None if init is None else jnp.asarray(init))


def run(inp, cu, chunk_size, impl, **kw):
    return ssd_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], dt_bias=inp["dt_bias"],
                          cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=chunk_size,
                          initial_states=inp["init"], impl=impl, interpret=(impl == "pallas"), **kw)


# (T, H, P, G, N, chunk, cu_seqlens): several groups, non-power-of-two P, 1-token sequences, an empty sequence,
# lengths that are not multiples of the chunk, trailing bucket padding (T > cu[-1]).
CASES = [
    (37, 4, 5, 2, 6, 8, [0, 1, 9, 20, 20, 33]),
    (24, 6, 12, 3, 8, 16, [0, 24]),
    (19, 2, 3, 1, 4, 4, [0, 1, 2, 3, 19]),
    (56, 4, 12, 2, 20, 16, [0, 3, 40, 51]),  # 37 tokens: three kernel blocks of 16, the last one short
    (61, 4, 40, 2, 16, 16, [0, 7, 44, 52]),  # head-dim tiles of 32 + 16 (8 real rows) or 32 + 32: TILE_OPTIONS
    (61, 4, 48, 2, 16, 16, [0, 7, 44, 52]),  # three 16-wide tiles
]

# Head-dim tiles (cases 4 and 5): the narrow last tile and the padded one, on one span and in 16-token segments.
TILE_OPTIONS = [(4, dict(block_p=32, segment_len=0)), (4, dict(block_p=32, narrow_last_tile=False, segment_len=0)),
                (4, dict(block_p=32, segment_len=16, block_t=16, state_block_t=16)),
                (5, dict(block_p=16, segment_len=0))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_naive_recurrence(impl, case):
    T, H, P, G, N, L, cu = CASES[case]
    rng = np.random.default_rng(case)
    inp = make_inputs(rng, T, H, P, G, N, len(cu) - 1, with_init=(case != 1))
    y, fin = run(inp, cu, L, impl)
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                inp["init"])
    assert y.dtype == jnp.float32
    assert fin.dtype == jnp.float32
    assert y.shape == (T, H, P)
    assert fin.shape == (len(cu) - 1, H, P, N)
    assert rms_relative_error(y, y_ref) < 1e-5
    assert rms_relative_error(fin, fin_ref) < 1e-5
    # Tokens past cu[-1] are bucket padding: zero output.
    assert np.all(np.asarray(y)[cu[-1]:] == 0)


@pytest.mark.parametrize("case, options", [(case, {}) for case in range(len(CASES))]
                         + [(0, dict(prefetch=False, segment_len=0)), (3, dict(prefetch=False, segment_len=0))]
                         + TILE_OPTIONS)
def test_pallas_matches_xla(case, options):
    """The kernel with its defaults (segments where the tiny shapes leave programs short, the next block's loads
    issued early), on one span per sequence without the early loads, and over head-dim tiles, against the XLA
    scan."""
    T, H, P, G, N, L, cu = CASES[case]
    inp = make_inputs(np.random.default_rng(100 + case), T, H, P, G, N, len(cu) - 1)
    y_k, f_k = ssd_chunk_scan_pallas(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                                     dt_bias=inp["dt_bias"], cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=L,
                                     initial_states=inp["init"], interpret=True, **options)
    y_x, f_x = run(inp, cu, L, "xla")
    assert rms_relative_error(y_k, y_x) < 1e-5
    assert rms_relative_error(f_k, f_x) < 1e-5
    assert np.all(np.asarray(y_k)[cu[-1]:] == 0)


def test_head_dim_tiles():
    assert head_dim_tiles(80, 64, narrow_last=True) == (64, 2, 16)  # Nano-9B: 80 = 64 + 16
    assert head_dim_tiles(80, 64, narrow_last=False) == (64, 2, 64)
    assert head_dim_tiles(80, 128, narrow_last=True) == (128, 1, 128)  # one tile: padded, not split
    assert head_dim_tiles(80, 32, narrow_last=True) == (32, 3, 16)
    assert head_dim_tiles(64, 32, narrow_last=True) == (32, 2, 32)
    assert head_dim_tiles(5, 64, narrow_last=True) == (16, 1, 16)  # Triton's 16-row minimum


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs(impl):
    # bf16 inputs are rounded once; the recurrence runs in float32, so the error is that of the bf16 output rounding
    # (2^-8 relative per element) plus, in the kernel, bf16 operands of the intra-chunk products: < 1e-2.
    T, H, P, G, N, L, cu = CASES[0]
    inp = make_inputs(np.random.default_rng(7), T, H, P, G, N, len(cu) - 1, dtype=jnp.bfloat16)
    y, fin = run(inp, cu, L, impl)
    y_ref, fin_ref = naive_scan(inp["x"].astype(jnp.float32), inp["dt"].astype(jnp.float32), inp["A"],
                                inp["B"].astype(jnp.float32), inp["C"].astype(jnp.float32), inp["D"],
                                inp["dt_bias"], cu, inp["init"])
    assert y.dtype == jnp.bfloat16
    assert fin.dtype == jnp.float32
    assert rms_relative_error(y, y_ref) < 1e-2
    assert rms_relative_error(fin, fin_ref) < 1e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_dt_limit_and_no_softplus(impl):
    T, H, P, G, N, L, cu = CASES[0]
    inp = make_inputs(np.random.default_rng(3), T, H, P, G, N, len(cu) - 1)
    y, fin = run(inp, cu, L, impl, dt_limit=(0.3, 0.9))
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                inp["init"], dt_limit=(0.3, 0.9))
    assert rms_relative_error(y, y_ref) < 1e-5
    assert rms_relative_error(fin, fin_ref) < 1e-5
    # dt_softplus=False takes dt + dt_bias as the step itself; feed softplus'd values and expect the same answer.
    sp = jax.nn.softplus(inp["dt"] + inp["dt_bias"]) - inp["dt_bias"]
    y2, fin2 = run(dict(inp, dt=sp), cu, L, impl, dt_softplus=False)
    y3, fin3 = run(inp, cu, L, impl)
    assert rms_relative_error(y2, y3) < 1e-5
    assert rms_relative_error(fin2, fin3) < 1e-5


def test_matches_transformers():
    """The reference equals HF NemotronH's torch chunk scan on a padded batch [B, T] packed as cu = [0, T, 2T]."""
    torch = pytest.importorskip("torch")
    nh = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    Bsz, T, H, P, G, N, L = 2, 21, 4, 6, 2, 8, 8
    rng = np.random.default_rng(11)
    inp = make_inputs(rng, Bsz * T, H, P, G, N, Bsz)
    t = lambda a, *shape: torch.from_numpy(np.array(a)).reshape(*shape)
    # Without the mamba_ssm kernels installed, this is HF's pure torch implementation.
    y_hf, fin_hf = nh.mamba2_chunk_scan(
        t(inp["x"], Bsz, T, H, P), t(inp["dt"], Bsz, T, H), t(inp["A"], H), t(inp["B"], Bsz, T, G, N),
        t(inp["C"], Bsz, T, G, N), chunk_size=L, D=t(inp["D"], H), dt_bias=t(inp["dt_bias"], H),
        initial_states=t(inp["init"], Bsz, H, P, N), dt_softplus=True, dt_limit=(0.001, float("inf")),
        return_final_states=True)
    y, fin = run(inp, [0, T, 2 * T], L, "xla", dt_limit=(0.001, float("inf")))
    assert rms_relative_error(y, y_hf.reshape(Bsz * T, H, P).numpy()) < 1e-5
    assert rms_relative_error(fin, fin_hf.numpy()) < 1e-5


# Segmented scan (sequences cut into segments of L tokens, states handed on between them), forced on these small
# shapes: (T, H, P, G, N, cu_seqlens, L). One long sequence of five segments, the last one short, before 4 padding
# tokens; long sequences (67 and 69 tokens: three segments each, the last short) packed with a 1-token sequence,
# an empty one and a short one. Blocks of 16 tokens: L / 16 blocks per segment.
SEGMENTED_CASES = [
    (84, 2, 12, 1, 20, [0, 80], 16),
    (150, 4, 5, 2, 6, [0, 3, 70, 71, 71, 140], 32),
]


def run_segmented(inp, cu, segment_len, **kw):
    return ssd_chunk_scan_pallas(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                                 dt_bias=inp["dt_bias"], cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=16,
                                 initial_states=inp["init"], segment_len=segment_len, block_t=16, interpret=True,
                                 **kw)


# state_block_t: the block length of the segment state phase (16 in case 1: two blocks per 32-token segment; by
# default one block per segment here); prefetch (the default): each block's loads issued one block early, in every
# phase; off too.
@pytest.mark.parametrize("case, options", [(0, dict(state_block_t=16)), (1, dict(state_block_t=16, prefetch=False)),
                                           (1, dict(prefetch=False))])
def test_segmented_matches_naive_recurrence(case, options):
    T, H, P, G, N, cu, L = SEGMENTED_CASES[case]
    inp = make_inputs(np.random.default_rng(40 + case), T, H, P, G, N, len(cu) - 1)
    y, fin = run_segmented(inp, cu, L, **options)
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                inp["init"])
    assert y.shape == (T, H, P)
    assert fin.shape == (len(cu) - 1, H, P, N)
    assert rms_relative_error(y, y_ref) < 1e-5
    assert rms_relative_error(fin, fin_ref) < 1e-5
    assert np.all(np.asarray(y)[cu[-1]:] == 0)


def test_segmented_without_initial_states():
    T, H, P, G, N, cu, L = SEGMENTED_CASES[1]
    inp = make_inputs(np.random.default_rng(50), T, H, P, G, N, len(cu) - 1, with_init=False)
    y, fin = run_segmented(inp, cu, L)
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                None)
    assert rms_relative_error(y, y_ref) < 1e-5
    assert rms_relative_error(fin, fin_ref) < 1e-5
    # The empty sequence (row 3) owns no segment: its final state is its (zero) initial state all the same.
    assert np.all(np.asarray(fin)[3] == 0)


def test_segmented_bf16_inputs():
    # The tolerance of `test_bf16_inputs`: bf16 output rounding and bf16 operands of the block products.
    T, H, P, G, N, cu, L = SEGMENTED_CASES[1]
    inp = make_inputs(np.random.default_rng(51), T, H, P, G, N, len(cu) - 1, dtype=jnp.bfloat16)
    y, fin = run_segmented(inp, cu, L)
    y_ref, fin_ref = naive_scan(inp["x"].astype(jnp.float32), inp["dt"].astype(jnp.float32), inp["A"],
                                inp["B"].astype(jnp.float32), inp["C"].astype(jnp.float32), inp["D"],
                                inp["dt_bias"], cu, inp["init"])
    assert y.dtype == jnp.bfloat16
    assert rms_relative_error(y, y_ref) < 1e-2
    assert rms_relative_error(fin, fin_ref) < 1e-2


def test_segmented_rejects_segments_not_made_of_blocks():
    T, H, P, G, N, cu, _ = SEGMENTED_CASES[0]
    inp = make_inputs(np.random.default_rng(0), T, H, P, G, N, len(cu) - 1)
    with pytest.raises(ValueError, match="segment_len"):
        run_segmented(inp, cu, 24)


def test_segments_only_when_sequences_leave_the_gpu_short_of_programs():
    # 32-token blocks. Nano-30B (H=64, P=64): one 8k sequence gives 128 programs, 16 sequences 1024; Nano-9B (H=128,
    # P=80): one sequence already gives 256.
    L = _default_segment_len(8192, 1, 64, 64, 32)
    assert L > 0 and 8192 // L >= 2
    assert _default_segment_len(8192, 16, 64, 64, 32) == 0
    assert _default_segment_len(8192, 1, 128, 80, 32) == 0
    assert _default_segment_len(300, 1, 64, 64, 32) == 0  # too short for two segments


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tiles", [dict(segment_len=512), dict(segment_len=0, block_p=64)])
def test_scan_lowers_to_triton(pooled, dtype, tiles, cuda_lowering):
    """The scan's kernels lower to Triton at Nano-9B's shape (P = 80): segmented (three kernels, one masked 128-wide
    head-dim tile) and on one span in 64-wide tiles (one kernel, a wide and a narrow 16-wide tile body)."""
    T, H, P, G, N, S = 2048, 128, 80, 8, 128, 4
    sds = jax.ShapeDtypeStruct
    if pooled:
        f = jax.jit(lambda x, dt, A, B, C, D, dtb, cu, pool, slots, flags: ssd_chunk_scan_pooled(
            x, dt, A, B, C, D=D, dt_bias=dtb, cu_seqlens=cu, state_pool=pool, slot_ids=slots,
            has_initial_state=flags, chunk_size=128, impl="pallas", **tiles))
        extra = (sds((9, H, P, N), jnp.float32), sds((S,), jnp.int32), sds((S,), jnp.bool_))
    else:
        f = jax.jit(lambda x, dt, A, B, C, D, dtb, cu, init: ssd_chunk_scan_pallas(
            x, dt, A, B, C, D=D, dt_bias=dtb, cu_seqlens=cu, initial_states=init, chunk_size=128, **tiles))
        extra = (sds((S, H, P, N), jnp.float32),)
    text = cuda_lowering(f, sds((T, H, P), dtype), sds((T, H), dtype), sds((H,), jnp.float32),
                         sds((T, G, N), dtype), sds((T, G, N), dtype), sds((H,), jnp.float32),
                         sds((H,), jnp.float32), sds((S + 1,), jnp.int32), *extra)
    assert text.count("__gpu$xla.gpu.triton") == (3 if tiles["segment_len"] else 1)


# Pooled variant. One packing of 7 sequence rows on a pool of 9 slots: row 0 continues from slot 3 with 11 tokens (not
# a multiple of the chunk), rows 1, 5, 6 are padding on slot 0 (two of them flagged as continuing: they must still
# read nothing), row 2 continues from slot 5 with 1 token, row 3 starts fresh on slot 6 with 18 tokens, row 4
# continues from slot 1 with 21 tokens (two kernel blocks of 16, the last one short). Slots 2, 4, 7, 8 are idle.
POOL_SLOTS = [3, 0, 5, 6, 1, 0, 0]
POOL_HAS_INIT = [True, True, True, False, True, False, True]
POOL_CU = [0, 11, 11, 12, 30, 51, 51, 51]
NUM_SLOTS = 9


def make_pool(rng, H, P, N, dtype):
    """Random states in the slots that continuing sequences read and NaN in every other slot (the null slot, idle
    slots, the fresh sequence's slot): a read of any of those would put NaN into y or a final state."""
    pool = np.full((NUM_SLOTS, H, P, N), np.nan, np.float32)
    for slot, has_init, n in zip(POOL_SLOTS, POOL_HAS_INIT, np.diff(POOL_CU)):
        if has_init and n:
            pool[slot] = rng.standard_normal((H, P, N))
    return jnp.asarray(pool, dtype)


def run_pooled(inp, pool, cu, chunk_size, impl, interpret=None, **kernel_options):
    return ssd_chunk_scan_pooled(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"], dt_bias=inp["dt_bias"],
        cu_seqlens=jnp.asarray(cu, jnp.int32), chunk_size=chunk_size, state_pool=pool,
        slot_ids=jnp.asarray(POOL_SLOTS, jnp.int32), has_initial_state=jnp.asarray(POOL_HAS_INIT), impl=impl,
        interpret=(impl == "pallas") if interpret is None else interpret, **kernel_options)


def pooled_reference(inp, pool, cu, chunk_size):
    """The unpooled XLA scan from the states the pooled call must read: (y, final states of the non-empty rows,
    their slots)."""
    live = np.diff(cu) > 0
    reads = live & np.asarray(POOL_HAS_INIT)
    init = np.where(reads[:, None, None, None], np.asarray(pool.astype(jnp.float32))[POOL_SLOTS], 0.0)
    y, fin = run(dict(inp, init=jnp.asarray(init)), cu, chunk_size, "xla")
    return y, np.asarray(fin)[live], np.asarray(POOL_SLOTS)[live]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# The segmented kernel in 16-token segments: rows 3 and 4 are two segments each, so the state passing reads row 4's
# slot and must not read row 3's (fresh: NaN there), and their second segments' programs write the final states.
# With P = 24 in 16-wide tiles (a narrow last tile of 8 real rows) every row of a written slot must come from the right
# program, on one span and in segments.
POOLED_RUNS = [("xla", {}), ("pallas", {}), ("pallas", dict(segment_len=16, block_t=16, state_block_t=16)),
               ("pallas", dict(P=24, block_p=16, segment_len=0)),
               ("pallas", dict(P=24, block_p=16, segment_len=16, block_t=16, state_block_t=16))]


@pytest.mark.parametrize("impl, options", POOLED_RUNS)
@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_pooled_matches_unpooled(impl, options, pool_dtype):
    options = dict(options)
    T, H, P, G, N, L = 56, 4, options.pop("P", 5), 2, 6, 8  # tokens 51..55 are bucket padding
    rng = np.random.default_rng(21)
    inp = make_inputs(rng, T, H, P, G, N, len(POOL_SLOTS), with_init=False)
    pool = make_pool(rng, H, P, N, pool_dtype)
    y_ref, fin_ref, written = pooled_reference(inp, pool, POOL_CU, L)
    y, new_pool = run_pooled(inp, pool, POOL_CU, L, impl, **options)
    idle = np.setdiff1d(np.arange(NUM_SLOTS), written)
    # The pool's values are exact in float32, so y is the unpooled scan's (to the 1e-5 of the tests above); a
    # bfloat16 pool rounds each final state once, at most 2^-9 relative per element.
    state_tol = 1e-5 if pool_dtype == jnp.float32 else 2.0 ** -8
    assert new_pool.dtype == pool_dtype
    assert rms_relative_error(y, y_ref) < 1e-5
    assert np.all(np.asarray(y)[POOL_CU[-1]:] == 0)
    assert rms_relative_error(np.asarray(new_pool.astype(jnp.float32))[written], fin_ref) < state_tol
    assert np.array_equal(bits(new_pool)[idle], bits(pool)[idle])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_pooled_read_only_leaves_the_pool(impl):
    """write_states=False (speculative verify): the same y as the writing call, and every slot bit-identical."""
    T, H, P, G, N, L = 56, 4, 5, 2, 6, 8
    rng = np.random.default_rng(22)
    inp = make_inputs(rng, T, H, P, G, N, len(POOL_SLOTS), with_init=False)
    pool = make_pool(rng, H, P, N, jnp.float32)
    y_ref, _, _ = pooled_reference(inp, pool, POOL_CU, L)
    y, same_pool = run_pooled(inp, pool, POOL_CU, L, impl, write_states=False)
    assert rms_relative_error(y, y_ref) < 1e-5
    assert np.array_equal(bits(same_pool), bits(pool))


@pytest.mark.parametrize("bad", ["state_pool", "slot_ids"])
def test_pooled_rejects_mismatched_pool(bad):
    T, H, P, G, N, L = 56, 4, 5, 2, 6, 8
    inp = make_inputs(np.random.default_rng(0), T, H, P, G, N, len(POOL_SLOTS), with_init=False)
    pool = jnp.zeros((NUM_SLOTS, H, P, N + (bad == "state_pool")))
    slots = jnp.zeros((len(POOL_SLOTS) + (bad == "slot_ids"),), jnp.int32)
    with pytest.raises(ValueError, match=bad):
        ssd_chunk_scan_pooled(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                              dt_bias=inp["dt_bias"], cu_seqlens=jnp.asarray(POOL_CU, jnp.int32), chunk_size=L,
                              state_pool=pool, slot_ids=slots, has_initial_state=jnp.ones((len(POOL_SLOTS),), bool),
                              impl="xla")


@pytest.mark.gpu
def test_compiled_pooled_kernel_on_gpu():
    """The compiled pooled kernel at Nano-9B's shape (bf16 inputs, float32 pool), with the pool donated into a jit
    as the engine does, against the XLA path: bf16 to 1e-2 as in `test_bf16_inputs`, idle slots bit-identical."""
    H, P, N, G, L = 128, 80, 128, 8, 128
    cu = [0, 75, 75, 76, 141, 300, 300, 300]  # 159 tokens: four kernel blocks of 32 and a short one
    T = 320
    rng = np.random.default_rng(5)
    inp = make_inputs(rng, T, H, P, G, N, len(POOL_SLOTS), dtype=jnp.bfloat16, with_init=False)
    pool = make_pool(rng, H, P, N, jnp.float32)
    step = jax.jit(lambda pool, inp: run_pooled(inp, pool, cu, L, "pallas", interpret=False), donate_argnums=0)
    y_k, pool_k = step(jnp.array(pool), inp)
    y_x, pool_x = run_pooled(inp, pool, cu, L, "xla")
    written = np.asarray(POOL_SLOTS)[np.diff(cu) > 0]
    idle = np.setdiff1d(np.arange(NUM_SLOTS), written)
    assert rms_relative_error(y_k.astype(jnp.float32), y_x.astype(jnp.float32)) < 1e-2
    assert np.all(np.asarray(y_k.astype(jnp.float32))[cu[-1]:] == 0)
    assert rms_relative_error(np.asarray(pool_k)[written], np.asarray(pool_x)[written]) < 1e-2
    assert np.array_equal(bits(pool_k)[idle], bits(pool)[idle])


@pytest.mark.gpu
def test_compiled_kernels_on_gpu():
    """All four compiled Mamba kernels against their XLA references on the GPU (the checks of
    `bench/mamba_kernels.py --check`: fp32 to 1e-5, bf16 to 1e-2, padding and idle slots bit-identical)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "bench" / "mamba_kernels.py"
    spec = importlib.util.spec_from_file_location("mamba_kernels_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.check()
