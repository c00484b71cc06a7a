"""causal_conv1d / causal_conv1d_update: XLA reference and Pallas kernel (interpret mode on CPU) against a float64
rolling-state convolution run token by token."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.causal_conv1d import causal_conv1d, causal_conv1d_pooled, causal_conv1d_update
from tests.numerics import rms_relative_error

IMPLS = ["xla", "pallas"]


def silu(v):
    return v / (1.0 + np.exp(-v))


def naive_conv(x, w, b, cu, init, activation):
    """Roll a [C, K-1] state through each sequence one token at a time, in float64."""
    x, w, b = [np.asarray(a, np.float64) for a in (x, w, b)]
    T, Cd = x.shape
    K = w.shape[1]
    S = len(cu) - 1
    y = np.zeros_like(x)
    fin = np.zeros((S, Cd, K - 1))
    for s in range(S):
        st = np.zeros((Cd, K - 1)) if init is None else np.asarray(init[s], np.float64).copy()
        for t in range(cu[s], cu[s + 1]):
            win = np.concatenate([st, x[t][:, None]], axis=1)
            v = (win * w).sum(1) + b
            y[t] = silu(v) if activation else v
            st = win[:, 1:]
        fin[s] = st
    return y, fin


# (T, C, K, cu): 1-token sequences (shorter than K-1, so part of the initial state stays), an empty sequence,
# channel count not a power of two, trailing bucket padding.
CASES = [
    (23, 7, 4, [0, 1, 2, 10, 10, 20]),
    (16, 40, 4, [0, 16]),
    (9, 3, 2, [0, 3, 9]),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_conv_matches_naive(impl, activation, case):
    T, Cd, K, cu = CASES[case]
    rng = np.random.default_rng(case)
    x = rng.standard_normal((T, Cd)).astype(np.float32)
    w = rng.standard_normal((Cd, K)).astype(np.float32)
    b = rng.standard_normal(Cd).astype(np.float32)
    init = None if case == 1 else rng.standard_normal((len(cu) - 1, Cd, K - 1)).astype(np.float32)
    y, fin = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cu_seqlens=jnp.asarray(cu, jnp.int32),
                           initial_states=None if init is None else jnp.asarray(init), activation=activation,
                           impl=impl, interpret=(impl == "pallas"))
    y_ref, fin_ref = naive_conv(x, w, b, cu, init, activation)
    assert y.shape == (T, Cd)
    assert fin.shape == (len(cu) - 1, Cd, K - 1)
    assert rms_relative_error(y, y_ref) < 1e-5
    assert rms_relative_error(fin, fin_ref) < 1e-6
    assert np.all(np.asarray(y)[cu[-1]:] == 0)


def test_conv_kernel_blocks_across_a_sequence():
    # Small token blocks so sequences span several kernel blocks (the default block is larger than these tests).
    from pallas_kernels.causal_conv1d_pallas import causal_conv1d_pallas

    cu = [0, 2, 37, 40]
    rng = np.random.default_rng(12)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((44, 20), (20, 4), (20,)))
    init = rng.standard_normal((3, 20, 3)).astype(np.float32)
    y, fin = causal_conv1d_pallas(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), cu_seqlens=jnp.asarray(cu),
                                  initial_states=jnp.asarray(init), interpret=True, block_t=16, block_c=16)
    y_ref, fin_ref = naive_conv(x, w, b, cu, init, "silu")
    assert rms_relative_error(y, y_ref) < 1e-5
    assert np.array_equal(np.asarray(fin), fin_ref.astype(np.float32))
    assert np.all(np.asarray(y)[40:] == 0)


def bits(a):
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("impl, options", [("xla", {}), ("pallas", {}), ("pallas", dict(block_t=4, block_c=16))])
def test_pooled_conv_reads_and_writes_only_the_real_slots(impl, options):
    """The engine's extend step: 6 sequence rows over a pool of 7 slots. Rows 0-2 continue from their slots (row 1
    is one token long, shorter than K-1, so its final state keeps part of the initial one), row 3 is fresh (its slot
    holds NaN, which must not be read), rows 4 and 5 are padding (empty, on the null slot 0, NaN too); tokens past
    cu[-1] are bucket padding. The real slots get the rolled states, every other slot keeps its bits, and y equals
    the unpooled conv from the gathered states. Token blocks of 4 (Pallas) put a sequence over several blocks."""
    T, Cd, K = 30, 20, 4
    cu = [0, 9, 10, 17, 25, 25, 25]
    slots = np.array([2, 5, 1, 6, 0, 0], np.int32)
    has_init = np.array([True, True, True, False, False, False])
    rng = np.random.default_rng(7)
    x, w, b = (rng.standard_normal(sh).astype(np.float32) for sh in ((T, Cd), (Cd, K), (Cd,)))
    pool = rng.standard_normal((7, Cd, K - 1)).astype(np.float32)
    pool[0] = pool[6] = np.nan
    init = np.where(has_init[:, None, None], pool[slots], 0.0)
    y, new_pool = causal_conv1d_pooled(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b),
                                       cu_seqlens=jnp.asarray(cu, jnp.int32), conv_pool=jnp.asarray(pool),
                                       slot_ids=jnp.asarray(slots), has_initial_state=jnp.asarray(has_init),
                                       impl=impl, interpret=(impl == "pallas"), **options)
    y_ref, fin_ref = naive_conv(x, w, b, cu, init, "silu")
    assert rms_relative_error(y, y_ref) < 1e-5
    assert np.all(np.asarray(y)[cu[-1]:] == 0)
    new_pool = np.asarray(new_pool)
    for row in range(4):
        np.testing.assert_allclose(new_pool[slots[row]], fin_ref[row], rtol=1e-6, atol=1e-6)
    for slot in (0, 3, 4):  # the null slot and idle slots
        assert np.array_equal(bits(new_pool[slot]), bits(pool[slot]))


@pytest.mark.parametrize("impl", IMPLS)
def test_conv_bf16(impl):
    T, Cd, K, cu = CASES[0]
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((T, Cd)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((Cd, K)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(Cd), jnp.bfloat16)
    init = jnp.asarray(rng.standard_normal((len(cu) - 1, Cd, K - 1)), jnp.bfloat16)
    y, fin = causal_conv1d(x, w, b, cu_seqlens=jnp.asarray(cu, jnp.int32), initial_states=init, impl=impl,
                           interpret=(impl == "pallas"))
    f = lambda a: np.asarray(a.astype(jnp.float32))
    y_ref, fin_ref = naive_conv(f(x), f(w), f(b), cu, f(init), "silu")
    # float32 sums of bf16 values, then one bf16 rounding of y (2^-8 relative); final states are copies: exact.
    assert y.dtype == jnp.bfloat16
    assert rms_relative_error(f(y), y_ref) < 1e-2
    assert fin.dtype == jnp.bfloat16
    assert np.array_equal(f(fin), fin_ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["silu", None])
def test_update_matches_naive_and_leaves_other_slots(impl, activation):
    slots, Cd, K = 7, 12, 4
    ids = [5, 0, 2, 0, 6]
    rng = np.random.default_rng(8)
    state = rng.standard_normal((slots, Cd, K - 1)).astype(np.float32)
    x = rng.standard_normal((len(ids), Cd)).astype(np.float32)
    w = rng.standard_normal((Cd, K)).astype(np.float32)
    b = rng.standard_normal(Cd).astype(np.float32)
    y, new = causal_conv1d_update(jnp.asarray(x), jnp.asarray(state), jnp.asarray(w), jnp.asarray(b),
                                  slot_ids=jnp.asarray(ids, jnp.int32), activation=activation, impl=impl,
                                  interpret=(impl == "pallas"))
    new = np.asarray(new)
    for r, s in enumerate(ids):
        if s == 0:
            continue
        y_ref, fin_ref = naive_conv(x[r:r + 1], w, b, [0, 1], state[s:s + 1], activation)
        assert rms_relative_error(np.asarray(y)[r], y_ref[0]) < 1e-5
        assert np.array_equal(new[s], fin_ref[0].astype(np.float32))
    idle = [s for s in range(1, slots) if s not in ids]
    assert np.array_equal(new[idle], state[idle])


@pytest.mark.parametrize("impl", IMPLS)
def test_update_padding_rows_do_not_change_real_results(impl):
    slots, Cd, K = 4, 8, 4
    rng = np.random.default_rng(2)
    state = jnp.asarray(rng.standard_normal((slots, Cd, K - 1)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, Cd)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((Cd, K)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(Cd), jnp.float32)
    kw = dict(impl=impl, interpret=(impl == "pallas"))
    y1, s1 = causal_conv1d_update(x[1:2], state, w, b, slot_ids=jnp.asarray([2], jnp.int32), **kw)
    y3, s3 = causal_conv1d_update(x, state, w, b, slot_ids=jnp.asarray([0, 2, 0], jnp.int32), **kw)
    assert np.array_equal(np.asarray(y1[0]), np.asarray(y3[1]))
    assert np.array_equal(np.asarray(s1)[1:], np.asarray(s3)[1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_update_reads_its_columns_of_a_wider_input(impl):
    """x_offset: the conv input as columns of a packed projection gives what the sliced input gives, bit for bit."""
    slots, Cd, K = 5, 12, 4
    rng = np.random.default_rng(11)
    state = jnp.asarray(rng.standard_normal((slots, Cd, K - 1)), jnp.float32)
    wide = jnp.asarray(rng.standard_normal((3, 5 + Cd + 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((Cd, K)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(Cd), jnp.float32)
    kw = dict(slot_ids=jnp.asarray([4, 0, 1], jnp.int32), impl=impl, interpret=(impl == "pallas"))
    y_wide, s_wide = causal_conv1d_update(wide, jnp.array(state), w, b, x_offset=5, **kw)
    y_cut, s_cut = causal_conv1d_update(wide[:, 5:5 + Cd], state, w, b, **kw)
    assert np.array_equal(np.asarray(y_wide), np.asarray(y_cut))
    assert np.array_equal(np.asarray(s_wide)[1:], np.asarray(s_cut)[1:])
    with pytest.raises(ValueError, match="no columns"):
        causal_conv1d_update(wide, state, w, b, x_offset=9, **kw)


@pytest.mark.parametrize("impl, options", [("xla", {}), ("pallas", {}), ("pallas", dict(block_t=4, block_c=16))])
@pytest.mark.parametrize("pooled", [False, True])
def test_prefill_conv_reads_columns_of_a_wider_input_and_splits_its_output(impl, options, pooled):
    """x_offset and split_at (how Mamba2 calls it: the x‖B‖C columns of its projection in, x and B‖C out) give the
    conv of the sliced input, split, bit for bit; also where the split is no multiple of the channel block (12 =
    8 + 4: the kernel narrows its blocks to 4) and with sequences over several token blocks."""
    T, Cd, K, off, split = 30, 20, 4, 5, 12
    cu = jnp.asarray([0, 9, 10, 17, 25, 25], jnp.int32)
    rng = np.random.default_rng(13)
    wide = jnp.asarray(rng.standard_normal((T, off + Cd + 3)), jnp.float32)
    w, b = (jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in ((Cd, K), (Cd,)))
    states = jnp.asarray(rng.standard_normal((6 if pooled else 5, Cd, K - 1)), jnp.float32)
    kw = dict(impl=impl, interpret=(impl == "pallas"), **options)
    if pooled:
        pool_kw = dict(slot_ids=jnp.asarray([2, 5, 1, 3, 0], jnp.int32),
                       has_initial_state=jnp.asarray([True, True, False, True, False]))
        conv = lambda x, **more: causal_conv1d_pooled(x, w, b, cu_seqlens=cu, conv_pool=jnp.array(states),  # noqa: E731
                                                      **pool_kw, **kw, **more)
    else:
        conv = lambda x, **more: causal_conv1d(x, w, b, cu_seqlens=cu, initial_states=states, **kw,  # noqa: E731
                                               **more)
    (y_x, y_bc), states_wide = conv(wide, x_offset=off, split_at=split)
    y_cut, states_cut = conv(wide[:, off:off + Cd])
    assert y_x.shape == (T, split) and y_bc.shape == (T, Cd - split)
    assert np.array_equal(np.concatenate([y_x, y_bc], axis=1), np.asarray(y_cut))
    assert np.array_equal(np.asarray(states_wide), np.asarray(states_cut))
    with pytest.raises(ValueError, match="no columns"):
        conv(wide, x_offset=9)
    with pytest.raises(ValueError, match="split_at"):
        conv(wide[:, off:off + Cd], split_at=Cd)


@pytest.mark.parametrize("states", ["zeros", "given", "pooled"])
def test_conv_lowers_to_triton(states, cuda_lowering):
    """The prefill conv lowers to Triton at Nano-9B's conv width (12,288 channels, K = 4, bf16) with each source of
    states: none, given per sequence, and the slot pool updated in place."""
    T, Cd, K, S = 2048, 12288, 4, 256
    sds = jax.ShapeDtypeStruct
    args = [sds((T, Cd), jnp.bfloat16), sds((Cd, K), jnp.bfloat16), sds((Cd,), jnp.bfloat16), sds((S + 1,), jnp.int32)]
    if states == "pooled":  # as Mamba2 calls it: the x‖B‖C columns of the projection in, x and B‖C out
        f = jax.jit(lambda x, w, b, cu, pool, slots, flags: causal_conv1d_pooled(
            x, w, b, cu_seqlens=cu, conv_pool=pool, slot_ids=slots, has_initial_state=flags, impl="pallas",
            x_offset=10240, split_at=10240))
        args[0] = sds((T, 10240 + Cd + 128), jnp.bfloat16)
        args += [sds((S + 1, Cd, K - 1), jnp.bfloat16), sds((S,), jnp.int32), sds((S,), jnp.bool_)]
    elif states == "given":
        f = jax.jit(lambda x, w, b, cu, init: causal_conv1d(x, w, b, cu_seqlens=cu, initial_states=init,
                                                            impl="pallas"))
        args.append(sds((S, Cd, K - 1), jnp.bfloat16))
    else:
        f = jax.jit(lambda x, w, b, cu: causal_conv1d(x, w, b, cu_seqlens=cu, impl="pallas"))
    assert cuda_lowering(f, *args).count("__gpu$xla.gpu.triton") == 1
