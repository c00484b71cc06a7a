"""FP8 GEMMs (XLA reference) against numpy written the way DeepSeek's reference kernel computes a block-scaled GEMM:
per 128-column block, e4m3 activations times e4m3 weights, each partial product scaled by the activation's and the
weight's scale, accumulated in float64 here. Per-tensor (ModelOpt) the same with one static scale each.

The quantizers agree bit for bit (the same float32 products with reciprocals, the same round-to-nearest-even cast);
the GEMMs then differ by float32 summation order only: 1e-6 relative (RMS) is ample, and a wrong block, scale or
group shows at 1e-2 and beyond.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import dequantize_weight, fp8_grouped_matmul, fp8_matmul, quantize_activations
from tests.numerics import rms_relative_error

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = (128, 128)
M, K, N = 6, 320, 192  # K: two whole column blocks and a half one; N: one whole row block and a half one


def numpy_act_quant(x, group, pow2=False):
    """Per row and `group` columns: (e4m3 values as float64, float32 scales), DeepSeek's act_quant."""
    x = np.asarray(x, np.float32)
    values, scales = np.zeros(x.shape), []
    for start in range(0, x.shape[1], group):
        part = x[:, start:start + group]
        scale = np.maximum(np.abs(part).max(1), np.float32(1e-4)) * np.float32(1 / 448)
        if pow2:
            scale = np.exp2(np.ceil(np.log2(scale.astype(np.float64)))).astype(np.float32)
        inverse = np.float32(1) / scale
        values[:, start:start + group] = np.clip(part * inverse[:, None], -448, 448).astype(E4M3).astype(np.float64)
        scales.append(scale)
    return values, np.stack(scales, 1)


def numpy_block_gemm(x, w8, w_scale, pow2=False):
    bn, bk = BLOCK
    x8, x_scale = numpy_act_quant(x, bk, pow2)
    w8 = np.asarray(w8).astype(np.float64)
    out = np.zeros((x8.shape[0], w8.shape[0]))
    for kb in range(x_scale.shape[1]):
        cols = slice(kb * bk, (kb + 1) * bk)
        for nb in range(w_scale.shape[0]):
            rows = slice(nb * bn, (nb + 1) * bn)
            out[:, rows] += (x8[:, cols] @ w8[rows, cols].T) * x_scale[:, kb, None] * float(w_scale[nb, kb])
    return out


def numpy_tensor_gemm(x, w8, w_scale, input_scale):
    x = np.asarray(x, np.float32)
    x8 = np.clip(x * (np.float32(1) / np.float32(input_scale)), -448, 448).astype(E4M3).astype(np.float64)
    return (x8 * float(input_scale)) @ (np.asarray(w8).astype(np.float64) * float(w_scale)).T


def random_fp8(key, shape):
    return (jax.random.normal(key, shape) * 40).astype(jnp.float8_e4m3fn)


def random_block_scales(key, lead=()):
    grid = lead + (-(-N // BLOCK[0]), -(-K // BLOCK[1]))
    return jax.random.uniform(key, grid, jnp.float32, 1e-3, 1e-2)


def activations(key, rows=M):
    """Rows with very different magnitudes per column block, so a wrong grouping of the scales shows."""
    x = jax.random.normal(key, (rows, K), jnp.float32)
    return x * jnp.array([1.0, 30.0, 0.01])[jnp.arange(K) // BLOCK[1]]


@pytest.mark.parametrize("pow2", [False, True])
def test_activation_quantization_matches_numpy_bit_for_bit(pow2):
    x = activations(jax.random.key(0))
    x8, scale = quantize_activations(x, BLOCK[1], pow2_scales=pow2)
    want_values, want_scales = numpy_act_quant(x, BLOCK[1], pow2)
    assert x8.dtype == jnp.float8_e4m3fn and scale.shape == (M, 3)
    np.testing.assert_array_equal(np.asarray(scale), want_scales)
    np.testing.assert_array_equal(np.asarray(x8, np.float64), want_values)


def test_activation_rounding_error_is_within_e4m3_half_ulp():
    """What the model tests' error bound rests on: per element |x8·s - x| <= 2^-4 |x| where x8 is a normal e4m3
    number (|x| >= 2^-6 s), and <= 2^-10 s (half the subnormal spacing) below that."""
    x = activations(jax.random.key(1), rows=64)
    x8, scale = quantize_activations(x, BLOCK[1])
    s = np.repeat(np.asarray(scale, np.float64), BLOCK[1], axis=1)[:, :K]
    x = np.asarray(x, np.float64)
    error = np.abs(np.asarray(x8, np.float64) * s - x)
    normal = np.abs(x) >= 2.0 ** -6 * s
    assert normal.mean() > 0.9
    assert (error[normal] <= 2.0 ** -4 * np.abs(x[normal])).all()
    assert (error[~normal] <= 2.0 ** -10 * s[~normal]).all()
    assert np.abs(np.asarray(x8, np.float64)).max(1).max() == 448  # each group's amax lands on e4m3's largest value


def test_all_zero_group_keeps_a_finite_scale():
    x8, scale = quantize_activations(jnp.zeros((2, 256)), 128)
    np.testing.assert_array_equal(np.asarray(scale), np.full((2, 2), np.float32(1e-4) * np.float32(1 / 448)))
    assert not np.asarray(x8, np.float32).any()


@pytest.mark.parametrize("pow2", [False, True])
def test_block_scaled_matmul(pow2):
    keys = jax.random.split(jax.random.key(2), 3)
    x, w8, w_scale = activations(keys[0]), random_fp8(keys[1], (N, K)), random_block_scales(keys[2])
    got = fp8_matmul(x, w8, w_scale, block=BLOCK, pow2_scales=pow2)
    assert got.shape == (M, N) and got.dtype == x.dtype
    assert rms_relative_error(got, numpy_block_gemm(x, w8, w_scale, pow2)) < 1e-6


def test_block_scaled_weight_dequantization_covers_partial_blocks():
    w8 = random_fp8(jax.random.key(3), (N, K))
    w_scale = random_block_scales(jax.random.key(4))
    want = np.asarray(w8, np.float64) * np.repeat(np.repeat(np.asarray(w_scale), 128, 0), 128, 1)[:N, :K]
    np.testing.assert_array_equal(np.asarray(dequantize_weight(w8, w_scale, BLOCK)), want.astype(np.float32))


def test_per_tensor_matmul_saturates_past_the_static_range():
    keys = jax.random.split(jax.random.key(5), 2)
    x = activations(keys[0])
    w8, w_scale = random_fp8(keys[1], (N, K)), jnp.float32(0.004)
    input_scale = jnp.float32(0.02)  # ±8.96: the 30x column block goes past it and must saturate, not turn NaN
    assert np.abs(np.asarray(x)).max() > 448 * 0.02
    got = fp8_matmul(x, w8, w_scale, block=None, input_scale=input_scale)
    assert np.isfinite(np.asarray(got)).all()
    assert rms_relative_error(got, numpy_tensor_gemm(x, w8, w_scale, input_scale)) < 1e-6


SIZES = [
    [2, 0, 5, 1],  # an empty group, 3 rows past the total (zeros)
    [0, 0, 0, 0],  # nothing routed
    [11, 0, 0, 0],  # one expert takes every row
]


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_block_scaled_matmul(sizes):
    E, rows = len(sizes), 11
    keys = jax.random.split(jax.random.key(6), 3)
    x, w8, w_scale = activations(keys[0], rows), random_fp8(keys[1], (E, N, K)), random_block_scales(keys[2], (E,))
    got = np.asarray(fp8_grouped_matmul(x, w8, w_scale, jnp.asarray(sizes), block=BLOCK))
    start = 0
    for g, n in enumerate(sizes):
        if n:
            want = numpy_block_gemm(x[start:start + n], w8[g], w_scale[g])
            assert rms_relative_error(got[start:start + n], want) < 1e-6, g
        start += n
    assert not got[start:].any()


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_per_tensor_matmul_uses_each_experts_scales(sizes):
    E, rows = len(sizes), 11
    keys = jax.random.split(jax.random.key(7), 2)
    x, w8 = activations(keys[0], rows) * 0.01, random_fp8(keys[1], (E, N, K))
    w_scale = jnp.array([0.001, 0.002, 0.004, 0.008], jnp.float32)
    input_scale = jnp.array([0.001, 0.002, 0.0005, 0.003], jnp.float32)
    got = np.asarray(fp8_grouped_matmul(x, w8, w_scale, jnp.asarray(sizes), block=None, input_scale=input_scale))
    start = 0
    for g, n in enumerate(sizes):
        if n:
            want = numpy_tensor_gemm(x[start:start + n], w8[g], w_scale[g], input_scale[g])
            assert rms_relative_error(got[start:start + n], want) < 1e-6, g
        start += n
    assert not got[start:].any()


def test_scales_that_do_not_fit_the_weight_are_refused():
    x, w8 = jnp.ones((2, K)), random_fp8(jax.random.key(8), (N, K))
    with pytest.raises(ValueError, match=r"needs scales of shape \(2, 3\), got \(2, 2\)"):
        fp8_matmul(x, w8, jnp.ones((2, 2)), block=BLOCK)
    with pytest.raises(ValueError, match="needs a static input_scale"):
        fp8_matmul(x, w8, jnp.float32(1), block=None)
    with pytest.raises(ValueError, match="impl must be one of"):
        fp8_matmul(x, w8, jnp.ones((2, 3)), block=BLOCK, impl="pallas")
