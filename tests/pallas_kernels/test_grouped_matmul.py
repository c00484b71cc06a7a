"""grouped_matmul: Pallas kernel (interpret mode) and the ragged_dot reference against a per-group numpy matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul
from pallas_kernels.grouped_matmul import ExtraExperts, make_schedule, relu2
from tests.numerics import rms_relative_error


def numpy_grouped(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = x[start:start + n] @ w[g]
        start += n
    return out  # rows past the total stay zero


@pytest.mark.parametrize("sizes", [
    [7, 0, 20, 0, 13],  # empty groups, 10 rows past the total, groups straddling 16-row tiles
    [0, 0, 0, 0, 0],  # nothing routed: all zeros
    [16, 16, 0, 18, 0],  # sums to M exactly
    [50, 0, 0, 0, 0],  # one expert takes every row
])
def test_grouped_matmul(sizes):
    M, K, N, E = 50, 32, 32, 5
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (E, K, N), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    want = numpy_grouped(x, w, sizes)
    ref = grouped_matmul(x, w, sizes, impl="xla")
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)
    # The kernel writes every output row itself, zeros past the total included.
    got = grouped_matmul(x, w, sizes, impl="pallas", interpret=True, block_m=16, block_n=16, block_k=16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_grouped_matmul_bf16():
    M, K, N, E = 40, 64, 48, 3  # N = 1.5 column tiles: masked edge
    x = jax.random.normal(jax.random.key(2), (M, K)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (E, K, N)).astype(jnp.bfloat16)
    sizes = jnp.array([9, 0, 25], jnp.int32)
    want = numpy_grouped(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    got = grouped_matmul(x, w, sizes, impl="pallas", interpret=True, block_m=16, block_n=32, block_k=32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=1e-1)


def test_schedule_covers_every_row_once_per_segment():
    M, bm = 50, 16
    sizes = jnp.array([7, 0, 20, 0, 13], jnp.int32)
    expert, tile, start, end = (np.asarray(a) for a in make_schedule(sizes, M, bm))
    assert len(expert) == -(-M // bm) + 5
    owner = np.full(M, -2)
    for e, t, s, n in zip(expert, tile, start, end):
        if e < 0:
            continue
        assert t * bm <= s < n <= (t + 1) * bm
        assert (owner[s:n] == -2).all()
        owner[s:n] = e
    np.testing.assert_array_equal(owner, np.repeat([0, 2, 4, 5], [7, 20, 13, 10]))  # 5 = the zero tail


def random_sizes(rng, rows: int, experts: int) -> np.ndarray:
    """Group sizes of `rows` (token, expert) pairs, some rows past the total (the zero tail) in half the draws."""
    routed = rows - int(rng.integers(0, rows // 2 + 1)) if rng.random() < 0.5 else rows
    return np.bincount(rng.integers(0, experts, routed), minlength=experts).astype(np.int32)


@pytest.mark.parametrize("M,E,bm", [(6, 128, 16), (1, 8, 16), (50, 5, 16), (37, 64, 16), (300, 16, 32), (8, 8, 16)])
def test_trimmed_schedule_keeps_every_item(M, E, bm):
    """trim_items sizes the item list by min(E, M) instead of E: the items used are the same, in the same order, and
    the untrimmed list has only padding past the trimmed one's length. Draws include each row on its own expert,
    the case with the most boundary tiles."""
    rng = np.random.default_rng(M * 1000 + E)
    draws = [random_sizes(rng, M, E) for _ in range(40)]
    spread = np.zeros(E, np.int32)
    spread[:min(E, M)] = 1  # one row per expert: every segment boundary inside a tile
    draws.append(spread)
    for sizes in draws:
        full = [np.asarray(a) for a in make_schedule(jnp.asarray(sizes), M, bm)]
        trimmed = [np.asarray(a) for a in make_schedule(jnp.asarray(sizes), M, bm, trim_items=True)]
        n = len(trimmed[0])
        assert n == -(-M // bm) + min(E, M)
        for a, b in zip(full, trimmed):
            np.testing.assert_array_equal(a[:n], b)
        assert (full[0][n:] == -1).all(), sizes


def test_trimmed_grouped_matmul_equals_numpy():
    """Decode's shape in small: 6 rows over 16 experts, one row past the routed ones."""
    M, K, N, E = 6, 32, 48, 16
    x = jax.random.normal(jax.random.key(8), (M, K), jnp.float32)
    w = jax.random.normal(jax.random.key(9), (E, K, N), jnp.float32)
    sizes = jnp.asarray([1, 0, 2, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0], jnp.int32)
    got = grouped_matmul(x, w, sizes, impl="pallas", interpret=True, block_m=16, block_n=16, block_k=16,
                         trim_items=True)
    np.testing.assert_allclose(np.asarray(got), numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("split", ["n", "k"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_extra_experts_are_windows_of_one_matrix(split, impl):
    """Experts 0 .. S-1 cut from one matrix (a shared expert's projection) equal those windows as stacked experts:
    numpy per group, the stack's groups after them unchanged, rows past the total zero, with the epilogue too."""
    M, K, N, E, S = 40, 32, 24, 3, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, K, N)), jnp.float32)
    matrix = jnp.asarray(rng.standard_normal((K, S * N) if split == "n" else (S * K, N)), jnp.float32)
    windows = ([matrix[:, j * N:(j + 1) * N] for j in range(S)] if split == "n"
               else [matrix[j * K:(j + 1) * K] for j in range(S)])
    sizes = jnp.asarray([7, 7, 6, 0, 9], jnp.int32)  # 29 of 40 rows; both extra experts take 7
    want = numpy_grouped(x, jnp.concatenate([jnp.stack(windows), w]), sizes)
    kw = dict(impl=impl, interpret=impl == "pallas", extra=ExtraExperts(matrix, split))
    if impl == "pallas":
        kw.update(block_m=16, block_n=16, block_k=16)
    got = grouped_matmul(x, w, sizes, **kw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    assert not np.asarray(got[29:]).any()
    fused = grouped_matmul(x, w, sizes, epilogue="relu2", **kw)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(relu2(got)))


def test_extra_experts_must_cut_evenly():
    x, w = jnp.zeros((4, 8)), jnp.zeros((2, 8, 6))
    with pytest.raises(ValueError, match="do not cut"):
        grouped_matmul(x, w, jnp.zeros(3, jnp.int32), impl="pallas", interpret=True,
                       extra=ExtraExperts(jnp.zeros((8, 10)), "n"))
    with pytest.raises(ValueError, match="group sizes"):
        grouped_matmul(x, w, jnp.zeros(2, jnp.int32), impl="pallas", interpret=True,
                       extra=ExtraExperts(jnp.zeros((8, 12)), "n"))


def test_grouped_matmul_lowers_to_triton(cuda_lowering):
    S = jax.ShapeDtypeStruct
    cuda_lowering(jax.jit(lambda x, w, g: grouped_matmul(x, w, g, impl="pallas")),
                  S((4096, 2688), jnp.bfloat16), S((128, 2688, 1856 // 2), jnp.bfloat16), S((128,), jnp.int32))


@pytest.mark.parametrize("split", ["n", "k"])
def test_extra_experts_lower_to_triton(cuda_lowering, split):
    S = jax.ShapeDtypeStruct
    K, N = (2688, 1856) if split == "n" else (1856, 2688)
    shape = (K, 2 * N) if split == "n" else (2 * K, N)
    cuda_lowering(jax.jit(lambda x, w, g, m: grouped_matmul(x, w, g, extra=ExtraExperts(m, split), impl="pallas",
                                                            epilogue="relu2")),
                  S((8, K), jnp.bfloat16), S((128, K, N), jnp.bfloat16), S((130,), jnp.int32), S(shape, jnp.bfloat16))


@pytest.mark.gpu
def test_grouped_matmul_on_gpu():
    M, K, N, E = 1000, 512, 640, 8
    x = jax.random.normal(jax.random.key(4), (M, K)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(5), (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    sizes = jnp.array([100, 0, 250, 3, 0, 400, 7, 0], jnp.int32)  # 760 of 1000 rows
    want = numpy_grouped(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    got = np.asarray(grouped_matmul(x, w, sizes, impl="pallas"), np.float64)
    assert rms_relative_error(got, want) < 1e-2
    assert (got[760:] == 0).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_relu2_epilogue_equals_the_activation_after(impl):
    """The epilogue rounds the product to the output dtype first, so it equals relu² applied afterwards, bit for
    bit, in bf16 too; rows past the groups stay zero."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((24, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 32, 48)) * 0.2, jnp.bfloat16)
    sizes = jnp.asarray([5, 0, 11], jnp.int32)
    kw = dict(impl=impl, interpret=(impl == "pallas"))
    fused = grouped_matmul(x, w, sizes, epilogue="relu2", **kw)
    after = relu2(grouped_matmul(x, w, sizes, **kw))
    assert np.array_equal(np.asarray(fused, np.float32), np.asarray(after, np.float32))
    assert not np.asarray(fused[16:], np.float32).any()
    with pytest.raises(ValueError, match="epilogue"):
        grouped_matmul(x, w, sizes, epilogue="gelu", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("split", ["n", "k"])
def test_extra_experts_on_gpu(split):
    """A shared expert cut in two and one token's six routed experts (Nemotron-30B's shapes), compiled, against the
    XLA reference on the stacked windows."""
    K, N = (2688, 1856) if split == "n" else (1856, 2688)
    x = jax.random.normal(jax.random.key(10), (8, K)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(11), (16, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    shape = (K, 2 * N) if split == "n" else (2 * K, N)
    extra = ExtraExperts((jax.random.normal(jax.random.key(12), shape) * K ** -0.5).astype(jnp.bfloat16), split)
    sizes = jnp.array([1, 1, 1, 0, 2, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0], jnp.int32)
    got = np.asarray(grouped_matmul(x, w, sizes, extra=extra, impl="pallas"), np.float64)
    want = np.asarray(grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), sizes, impl="xla",
                                     extra=ExtraExperts(extra.weights.astype(jnp.float32), split)), np.float64)
    assert rms_relative_error(got, want) < 1e-2


@pytest.mark.gpu
def test_relu2_epilogue_on_gpu():
    """The compiled kernel's epilogue equals relu² after the compiled kernel, bit for bit (one token's six experts,
    the decode tiles)."""
    x = jax.random.normal(jax.random.key(6), (6, 2688)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(7), (16, 2688, 1856)) * 2688 ** -0.5).astype(jnp.bfloat16)
    sizes = jnp.array([1, 0, 2, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0], jnp.int32)
    fused = grouped_matmul(x, w, sizes, epilogue="relu2", impl="pallas")
    after = relu2(grouped_matmul(x, w, sizes, impl="pallas"))
    assert np.array_equal(np.asarray(fused, np.float32), np.asarray(after, np.float32))
