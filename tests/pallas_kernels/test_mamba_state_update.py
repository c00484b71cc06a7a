"""ssd_state_update: XLA reference and Pallas kernel (interpret mode on CPU) against a float64 recurrence step."""

import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.mamba_state_update import ssd_state_update, ssd_state_update_packed
from tests.bitwise import jit_contracting_fmas
from tests.numerics import rms_relative_error

IMPLS = ["xla", "pallas"]


def naive_step(state, x, dt, A, B, C, D, dt_bias, slot_ids):
    state = np.asarray(state, np.float64).copy()
    x, dt, A, B, C, D, dt_bias = [np.asarray(a, np.float64) for a in (x, dt, A, B, C, D, dt_bias)]
    Bsz, H, P = x.shape
    G = B.shape[1]
    g = np.arange(H) // (H // G)
    d = np.logaddexp(dt + dt_bias, 0.0)
    y = np.zeros_like(x)
    for b in range(Bsz):
        s = slot_ids[b]
        h = np.exp(d[b] * A)[:, None, None] * state[s] + (d[b][:, None] * x[b])[:, :, None] * B[b, g][:, None, :]
        y[b] = np.einsum("hpn,hn->hp", h, C[b, g]) + D[:, None] * x[b]
        state[s] = h
    return y, state


def make(rng, slots, Bsz, H, P, G, N, dtype=np.float32):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(state=jnp.asarray(f(slots, H, P, N)), x=jnp.asarray(f(Bsz, H, P), dtype),
                dt=jnp.asarray(f(Bsz, H) - 1.0, dtype), A=jnp.asarray(-np.exp(rng.uniform(-2, 1, H)), jnp.float32),
                B=jnp.asarray(f(Bsz, G, N), dtype), C=jnp.asarray(f(Bsz, G, N), dtype), D=jnp.asarray(f(H)),
                dt_bias=jnp.asarray(f(H)))


def call(inp, slot_ids, impl):
    return ssd_state_update(inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], D=inp["D"],
                            dt_bias=inp["dt_bias"], slot_ids=jnp.asarray(slot_ids, jnp.int32), impl=impl,
                            interpret=(impl == "pallas"))


# (slots, H, P, G, N, slot_ids): non-power-of-two P and N, several groups, padded rows on slot 0 (several at once),
# slots left idle.
CASES = [
    (9, 4, 5, 2, 6, [3, 0, 7, 1, 0]),
    (5, 6, 12, 3, 16, [4, 2]),
    (4, 2, 3, 1, 4, [0]),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_naive_and_leaves_other_slots(impl, case):
    slots, H, P, G, N, ids = CASES[case]
    inp = make(np.random.default_rng(case), slots, len(ids), H, P, G, N)
    before = np.asarray(inp["state"]).copy()
    y, state = call(inp, ids, impl)
    y_ref, state_ref = naive_step(before, inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                  inp["dt_bias"], ids)
    state = np.asarray(state)
    real = [b for b, s in enumerate(ids) if s != 0]
    if real:
        assert rms_relative_error(np.asarray(y)[real], y_ref[real]) < 1e-5
        assert rms_relative_error(state[[ids[b] for b in real]], state_ref[[ids[b] for b in real]]) < 1e-5
    # Idle slots (named by no request) are bit-identical; slot 0 may hold garbage.
    idle = [s for s in range(1, slots) if s not in ids]
    assert np.array_equal(state[idle], before[idle])
    assert state.dtype == np.float32
    assert y.dtype == inp["x"].dtype


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_rows_do_not_change_real_results(impl):
    """A request's y and slot are bit-identical alone and inside a batch padded with slot-0 rows."""
    slots, H, P, G, N = 6, 4, 5, 2, 8
    rng = np.random.default_rng(5)
    big = make(rng, slots, 4, H, P, G, N)
    alone = {k: (v[2:3] if k not in ("state", "A", "D", "dt_bias") else v) for k, v in big.items()}
    y1, s1 = jit_contracting_fmas(lambda inp: call(inp, [3], impl))(alone)
    y4, s4 = jit_contracting_fmas(lambda inp: call(inp, [0, 0, 3, 0], impl))(big)
    assert np.array_equal(np.asarray(y1[0]), np.asarray(y4[2]))
    assert np.array_equal(np.asarray(s1)[1:], np.asarray(s4)[1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs(impl):
    # bf16 x/B/C/dt, float32 state: only the bf16 rounding of y (2^-8 relative) separates it from float64.
    slots, H, P, G, N, ids = CASES[0]
    inp = make(np.random.default_rng(9), slots, len(ids), H, P, G, N, dtype=jnp.bfloat16)
    y, state = call(inp, ids, impl)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    y_ref, state_ref = naive_step(inp["state"], f32(inp["x"]), f32(inp["dt"]), inp["A"], f32(inp["B"]),
                                  f32(inp["C"]), inp["D"], inp["dt_bias"], ids)
    assert y.dtype == jnp.bfloat16
    assert rms_relative_error(np.asarray(y.astype(jnp.float32))[[0, 2, 3]], y_ref[[0, 2, 3]]) < 1e-2
    assert rms_relative_error(np.asarray(state)[[3, 7, 1]], state_ref[[3, 7, 1]]) < 1e-5


def test_pallas_matches_xla():
    slots, H, P, G, N, ids = CASES[1]
    inp = make(np.random.default_rng(21), slots, len(ids), H, P, G, N)
    y_k, s_k = call(inp, ids, "pallas")
    y_x, s_x = call(inp, ids, "xla")
    assert rms_relative_error(y_k, y_x) < 1e-5
    assert rms_relative_error(np.asarray(s_k)[1:], np.asarray(s_x)[1:]) < 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_packed_inputs_equal_the_pieces(impl, case):
    """The packed entry (x‖B‖C in one array, dt at a column offset of a wider array, A as A_log) gives exactly what
    the pieces give: same kernel, same arithmetic, only the addresses differ."""
    slots, H, P, G, N, ids = CASES[case]
    rng = np.random.default_rng(40 + case)
    inp = make(rng, slots, len(ids), H, P, G, N, dtype=jnp.bfloat16)
    A_log = jnp.asarray(rng.uniform(-2, 1, H), jnp.float32)
    inp["A"] = -jnp.exp(A_log)
    Bsz = len(ids)
    xbc = jnp.concatenate([inp["x"].reshape(Bsz, H * P), inp["B"].reshape(Bsz, G * N),
                           inp["C"].reshape(Bsz, G * N)], axis=1)
    gate = jnp.asarray(rng.standard_normal((Bsz, 7)), jnp.bfloat16)  # columns before dt, as in in_proj's output
    wide_dt = jnp.concatenate([gate, inp["dt"], gate[:, :2]], axis=1)
    state_copy = jnp.array(inp["state"])
    y, state = ssd_state_update_packed(
        inp["state"], xbc, wide_dt, A_log, n_groups=G, dt_offset=7, D=inp["D"], dt_bias=inp["dt_bias"],
        slot_ids=jnp.asarray(ids, jnp.int32), impl=impl, interpret=(impl == "pallas"))
    inp["state"] = state_copy
    y_ref, state_ref = call(inp, ids, impl)
    assert np.array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    assert np.array_equal(np.asarray(state)[1:], np.asarray(state_ref)[1:])


def test_packed_shapes_are_checked():
    state = jnp.zeros((3, 4, 5, 6))
    with pytest.raises(ValueError, match="shape mismatch"):  # x‖B‖C one column short
        ssd_state_update_packed(state, jnp.zeros((2, 4 * 5 + 2 * 2 * 6 - 1)), jnp.zeros((2, 4)), jnp.zeros(4),
                                n_groups=2, D=None, dt_bias=None, slot_ids=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="shape mismatch"):  # dt's columns run past the array
        ssd_state_update_packed(state, jnp.zeros((2, 4 * 5 + 2 * 2 * 6)), jnp.zeros((2, 6)), jnp.zeros(4),
                                n_groups=2, dt_offset=3, D=None, dt_bias=None, slot_ids=jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize("requests_first, stream", [(True, False), (True, True), (False, True)])
def test_launch_order_and_streaming_hints_change_no_value(requests_first, stream):
    """The kernel's launch-order and eviction options (the H200 sweep's alternatives) compute the same values bit
    for bit: each program does the same arithmetic on the same tile, whichever order they run in."""
    from pallas_kernels.mamba_state_update_pallas import ssd_state_update_pallas

    slots, H, P, G, N, ids = CASES[1]
    inp = make(np.random.default_rng(33), slots, len(ids), H, P, G, N)
    args = [inp[k] for k in ("x", "dt", "A", "B", "C")]
    kwargs = dict(D=inp["D"], dt_bias=inp["dt_bias"], slot_ids=jnp.asarray(ids, jnp.int32), interpret=True)
    y_default, state_default = ssd_state_update_pallas(jnp.array(inp["state"]), *args, **kwargs)
    y, state = ssd_state_update_pallas(jnp.array(inp["state"]), *args, **kwargs, requests_first=requests_first,
                                       stream=stream)
    assert np.array_equal(np.asarray(y), np.asarray(y_default))
    assert np.array_equal(np.asarray(state)[1:], np.asarray(state_default)[1:])


def test_the_sweep_options_lower_to_triton(cuda_lowering):
    """Each launch-order / eviction variant the H200 sweep times lowers to a Triton kernel at Nano-9B's shape."""
    import jax

    from pallas_kernels.mamba_state_update_pallas import ssd_state_update_pallas

    H, P, N, G, B = 128, 80, 128, 8, 256
    S = jax.ShapeDtypeStruct
    args = (S((B + 1, H, P, N), jnp.float32), S((B, H, P), jnp.bfloat16), S((B, H), jnp.bfloat16),
            S((H,), jnp.float32), S((B, G, N), jnp.bfloat16), S((B, G, N), jnp.bfloat16), S((H,), jnp.float32),
            S((H,), jnp.float32), S((B,), jnp.int32))
    for requests_first in (True, False):
        for stream in (False, True):
            def update(state, x, dt, A, Bm, C, D, dt_bias, slots, requests_first=requests_first, stream=stream):
                return ssd_state_update_pallas(state, x, dt, A, Bm, C, D=D, dt_bias=dt_bias, slot_ids=slots,
                                               requests_first=requests_first, stream=stream)
            assert "triton" in cuda_lowering(jax.jit(update), *args)
