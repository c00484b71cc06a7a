"""ssd_chunk_scan: XLA reference and Pallas kernel (interpret mode on CPU) against a float64 per-token recurrence."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import mamba_ssd
from pallas_kernels.mamba_ssd import ssd_chunk_scan

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


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# (T, H, P, G, N, chunk, cu_seqlens): several groups, non-power-of-two P, 1-token sequences, an empty sequence,
# lengths that are not multiples of the chunk, trailing bucket padding (T > cu[-1]).
CASES = [
    (37, 4, 5, 2, 6, 8, [0, 1, 9, 20, 20, 33]),
    (24, 6, 12, 3, 8, 16, [0, 24]),
    (19, 2, 3, 1, 4, 4, [0, 1, 2, 3, 19]),
    (56, 4, 12, 2, 20, 16, [0, 3, 40, 51]),  # 37 tokens: three kernel blocks of 16, the last one short
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_naive_recurrence(impl, case):
    T, H, P, G, N, L, cu = CASES[case]
    rng = np.random.default_rng(case)
    inp = make_inputs(rng, T, H, P, G, N, len(cu) - 1, with_init=(case != 1))
    y, fin = run(inp, cu, L, impl)
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                inp["init"])
    assert y.dtype == jnp.float32 and fin.dtype == jnp.float32
    assert y.shape == (T, H, P) and fin.shape == (len(cu) - 1, H, P, N)
    assert rel(y, y_ref) < 1e-5
    assert rel(fin, fin_ref) < 1e-5
    # Tokens past cu[-1] are bucket padding: zero output.
    assert np.all(np.asarray(y)[cu[-1]:] == 0)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_pallas_matches_xla(case):
    T, H, P, G, N, L, cu = CASES[case]
    inp = make_inputs(np.random.default_rng(100 + case), T, H, P, G, N, len(cu) - 1)
    y_k, f_k = run(inp, cu, L, "pallas")
    y_x, f_x = run(inp, cu, L, "xla")
    assert rel(y_k, y_x) < 1e-5 and rel(f_k, f_x) < 1e-5


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
    assert y.dtype == jnp.bfloat16 and fin.dtype == jnp.float32
    assert rel(y, y_ref) < 1e-2 and rel(fin, fin_ref) < 1e-2


@pytest.mark.parametrize("impl", IMPLS)
def test_dt_limit_and_no_softplus(impl):
    T, H, P, G, N, L, cu = CASES[0]
    inp = make_inputs(np.random.default_rng(3), T, H, P, G, N, len(cu) - 1)
    y, fin = run(inp, cu, L, impl, dt_limit=(0.3, 0.9))
    y_ref, fin_ref = naive_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["dt_bias"], cu,
                                inp["init"], dt_limit=(0.3, 0.9))
    assert rel(y, y_ref) < 1e-5 and rel(fin, fin_ref) < 1e-5
    # dt_softplus=False takes dt + dt_bias as the step itself; feed softplus'd values and expect the same answer.
    sp = jax.nn.softplus(inp["dt"] + inp["dt_bias"]) - inp["dt_bias"]
    y2, fin2 = run(dict(inp, dt=sp), cu, L, impl, dt_softplus=False)
    y3, fin3 = run(inp, cu, L, impl)
    assert rel(y2, y3) < 1e-5 and rel(fin2, fin3) < 1e-5


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
    assert rel(y, y_hf.reshape(Bsz * T, H, P).numpy()) < 1e-5
    assert rel(fin, fin_hf.numpy()) < 1e-5


def test_chunk_table_never_mixes_sequences():
    cu = jnp.asarray([0, 1, 9, 20, 20, 33], jnp.int32)
    tab = jax.tree.map(np.asarray, mamba_ssd._chunk_table(cu, 40, 8))
    cu = np.asarray(cu)
    assert len(tab["seq"]) == mamba_ssd.num_chunks_bound(40, 5, 8)
    covered = np.zeros(40, int)
    for s, st, ln in zip(tab["seq"], tab["start"], tab["length"]):
        if ln:
            assert cu[s] <= st and st + ln <= cu[s + 1]
            covered[st:st + ln] += 1
    assert np.all(covered[:33] == 1) and np.all(covered[33:] == 0)


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
