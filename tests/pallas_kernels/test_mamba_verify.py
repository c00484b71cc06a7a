"""ssd_verify_scan_packed and ssd_state_advance_packed (XLA reference and Pallas kernels in interpret mode) against
L steps of a float64 decode recurrence, and, with a bfloat16 pool, against L calls of the decode update itself (the
pool rounds the state between steps; so must they)."""

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.mamba_state_update import ssd_state_update_packed
from pallas_kernels.mamba_verify import ssd_state_advance_packed, ssd_verify_scan_packed
from tests.numerics import rms_relative_error
from tests.pallas_kernels.test_mamba_state_update import naive_step

IMPLS = ["xla", "pallas"]
DT_OFFSET = 3  # dt sits at a column offset of a wider array, as in in_proj's output

# (slots, H, P, G, N, slot_ids, L): non-power-of-two P and N, several groups, padded rows on slot 0 (several at
# once), slots left idle, one token (k = 0) to four.
CASES = [
    (9, 4, 5, 2, 6, [3, 0, 7, 1, 0], 3),
    (5, 6, 12, 3, 16, [4, 2], 4),
    (4, 2, 32, 1, 8, [1], 1),
]


def make(rng, case, pool_dtype=jnp.float32):
    slots, H, P, G, N, ids, L = CASES[case]
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    S = len(ids)
    return dict(state=jnp.asarray(f(slots, H, P, N), pool_dtype), xbc=jnp.asarray(f(S * L, H * P + 2 * G * N)),
                dt=jnp.asarray(np.concatenate([f(S * L, DT_OFFSET), f(S * L, H) - 1.0, f(S * L, 2)], axis=1)),
                A_log=jnp.asarray(rng.uniform(-2, 1, H), jnp.float32), D=jnp.asarray(f(H)), dt_bias=jnp.asarray(f(H)),
                slot_ids=jnp.asarray(ids, jnp.int32), n_groups=G, length=L)


def pieces(inp, t):
    """Token t of every request, as the decode step takes them: x[S,H,P], dt[S,H], B/C[S,G,N]."""
    state, L, G = inp["state"], inp["length"], inp["n_groups"]
    H, P, N = state.shape[1:]
    rows = np.asarray(inp["xbc"])[t::L]
    x, B, C = np.split(rows, [H * P, H * P + G * N], axis=1)
    dt = np.asarray(inp["dt"])[t::L, DT_OFFSET:DT_OFFSET + H]
    return x.reshape(-1, H, P), dt, B.reshape(-1, G, N), C.reshape(-1, G, N)


def naive(inp, lengths):
    """float64: every token's y from L decode steps, and the state after lengths[s] of them."""
    state = np.asarray(inp["state"], np.float64)
    A = -np.exp(np.asarray(inp["A_log"], np.float64))
    ids = np.asarray(inp["slot_ids"])
    ys, committed = [], state.copy()
    for t in range(inp["length"]):
        x, dt, B, C = pieces(inp, t)
        y, state = naive_step(state, x, dt, A, B, C, inp["D"], inp["dt_bias"], ids)
        ys.append(y)
        for s, slot in enumerate(ids):
            if t < lengths[s]:
                committed[slot] = state[slot]
    return np.stack(ys, axis=1).reshape(-1, *ys[0].shape[1:]), committed


def verify(inp, impl, interpret=None):
    """interpret: Pallas in interpret mode (default for impl "pallas": the CPU tests run the kernel bodies so)."""
    interpret = impl == "pallas" if interpret is None else interpret
    return ssd_verify_scan_packed(inp["state"], inp["xbc"], inp["dt"], inp["A_log"], n_groups=inp["n_groups"],
                                  length=inp["length"], dt_offset=DT_OFFSET, D=inp["D"], dt_bias=inp["dt_bias"],
                                  slot_ids=inp["slot_ids"], impl=impl, interpret=interpret)


def advance(inp, lengths, impl, interpret=None):
    interpret = impl == "pallas" if interpret is None else interpret
    return ssd_state_advance_packed(inp["state"], inp["xbc"], inp["dt"], inp["A_log"], n_groups=inp["n_groups"],
                                    length=inp["length"], dt_offset=DT_OFFSET, dt_bias=inp["dt_bias"],
                                    slot_ids=inp["slot_ids"], lengths=jnp.asarray(lengths, jnp.int32), impl=impl,
                                    interpret=interpret)


def real_rows(inp):
    return [s for s, slot in enumerate(np.asarray(inp["slot_ids"])) if slot != 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_verify_outputs_equal_decode_steps_and_leave_the_pool(impl, case):
    inp = make(np.random.default_rng(case), case)
    before = np.asarray(inp["state"]).copy()
    y = np.asarray(verify(inp, impl))
    y_ref, _ = naive(inp, [0] * len(inp["slot_ids"]))
    L = inp["length"]
    rows = [s * L + t for s in real_rows(inp) for t in range(L)]
    assert rms_relative_error(y[rows], y_ref[rows]) < 1e-5
    assert y.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(inp["state"]), before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_commit_advances_each_slot_by_its_length(impl, case):
    inp = make(np.random.default_rng(10 + case), case)
    S, L = len(inp["slot_ids"]), inp["length"]
    lengths = [(s * 7 + 1) % (L + 1) for s in range(S)]  # every count 0..L across the cases
    before = np.asarray(inp["state"]).copy()
    state = np.asarray(advance(inp, lengths, impl))
    _, expected = naive(inp, lengths)
    slots = [int(inp["slot_ids"][s]) for s in real_rows(inp)]
    assert rms_relative_error(state[slots], expected[slots]) < 1e-5
    for s in real_rows(inp):
        if lengths[s] == 0:  # nothing accepted, not even rounded: the slot is bit-identical
            np.testing.assert_array_equal(state[int(inp["slot_ids"][s])], before[int(inp["slot_ids"][s])])
    idle = [s for s in range(1, before.shape[0]) if s not in np.asarray(inp["slot_ids"])]
    np.testing.assert_array_equal(state[idle], before[idle])


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.cpu_only)])
def test_bfloat16_pool_rounds_between_tokens_as_decode_steps_do(impl):
    """With a bfloat16 pool, verify's y and the commit equal L calls of the decode update (the XLA reference), which
    store the state rounded after each token. The kernel in interpret mode only on the CPU: on a GPU interpret mode
    is XLA, whose compiler drops the kernel's float32 -> bfloat16 -> float32 rounding as if it were exact (compiled,
    Triton keeps it: test_compiled_kernels_on_gpu)."""
    case = 1
    inp = make(np.random.default_rng(20), case, pool_dtype=jnp.bfloat16)
    S, L = len(inp["slot_ids"]), inp["length"]
    state, ys = inp["state"], []
    for t in range(L):
        x, dt, B, C = pieces(inp, t)
        H, P, N = state.shape[1:]
        packed = jnp.asarray(np.concatenate([x.reshape(S, -1), B.reshape(S, -1), C.reshape(S, -1)], axis=1))
        y, state = ssd_state_update_packed(state, packed, jnp.asarray(dt), inp["A_log"], n_groups=inp["n_groups"],
                                           D=inp["D"], dt_bias=inp["dt_bias"], slot_ids=inp["slot_ids"], impl="xla")
        ys.append(np.asarray(y))
    expected_y = np.stack(ys, axis=1).reshape(S * L, *ys[0].shape[1:])
    assert rms_relative_error(np.asarray(verify(inp, impl)), expected_y) < 1e-6
    committed = np.asarray(advance(inp, [L] * S, impl).astype(jnp.float32))
    slots = np.asarray(inp["slot_ids"])
    assert rms_relative_error(committed[slots], np.asarray(state.astype(jnp.float32))[slots]) < 1e-6


def nano9b_inputs(rng, S, L, pool_dtype=jnp.float32):
    """Nano-9B's Mamba shapes (128 heads of 80, state 128, 8 groups), bf16 activations, S requests of L tokens in a
    pool of S + 3 slots (slot 0 the null slot)."""
    H, P, N, G = 128, 80, 128, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return dict(state=jnp.asarray(f(S + 3, H, P, N), pool_dtype),
                xbc=jnp.asarray(f(S * L, H * P + 2 * G * N), jnp.bfloat16),
                dt=jnp.asarray(np.concatenate([f(S * L, DT_OFFSET), f(S * L, H) - 1.0], axis=1), jnp.bfloat16),
                A_log=jnp.asarray(rng.uniform(-2, 1, H), jnp.float32), D=jnp.asarray(f(H)), dt_bias=jnp.asarray(f(H)),
                slot_ids=jnp.asarray(rng.permutation(np.arange(1, S + 3))[:S], jnp.int32), n_groups=G, length=L)


def test_kernels_lower_to_triton(cuda_lowering):
    """Both kernels lower to one Triton call each at Nano-9B's shapes (checked without a GPU)."""
    import jax

    from pallas_kernels.mamba_verify_pallas import ssd_state_advance_pallas, ssd_verify_scan_pallas

    inp = nano9b_inputs(np.random.default_rng(0), 4, 3)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    args = [spec(inp[k]) for k in ("state", "xbc", "dt", "A_log", "D", "dt_bias", "slot_ids")]
    kw = dict(n_groups=inp["n_groups"], length=3, dt_offset=DT_OFFSET)

    def scan(state, xbc, dt, A_log, D, dt_bias, slots):
        return ssd_verify_scan_pallas(state, xbc, dt, A_log, D=D, dt_bias=dt_bias, slot_ids=slots, **kw)

    def commit(state, xbc, dt, A_log, D, dt_bias, slots):
        return ssd_state_advance_pallas(state, xbc, dt, A_log, dt_bias=dt_bias, slot_ids=slots,
                                        lengths=jnp.ones_like(slots), **kw)

    for fn in (scan, commit):
        assert cuda_lowering(jax.jit(fn), *args).count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("S, L", [(1, 4), (32, 2), (256, 3)])
@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernels_on_gpu(S, L, pool_dtype):
    """The compiled kernels against the XLA references at Nano-9B's shapes: y within its bf16 rounding, the
    committed states within float32 summation order, or with a bf16 pool within a few last-bit flips (the state
    left unrounded between tokens, as XLA would leave a convert pair, was 1.1e-3 off on the H200)."""
    inp = nano9b_inputs(np.random.default_rng(S), S, L, pool_dtype)
    y, y_ref = verify(inp, "pallas", interpret=False), verify(inp, "xla")
    assert rms_relative_error(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) < 4e-3
    lengths = [(s * 7 + 1) % (L + 1) for s in range(S)]
    state = np.asarray(advance(inp, lengths, "pallas", interpret=False).astype(jnp.float32))
    state_ref = np.asarray(advance(inp, lengths, "xla").astype(jnp.float32))
    tolerance = 1e-5 if pool_dtype == jnp.float32 else 3e-4
    assert rms_relative_error(state, state_ref) < tolerance
