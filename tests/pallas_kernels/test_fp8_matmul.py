"""FP8 GEMMs: the XLA reference against numpy written the way DeepSeek's reference kernel computes a block-scaled GEMM:
per 128-column block, e4m3 activations times e4m3 weights, each partial product scaled by the activation's and the
weight's scale, accumulated in float64 here. Per-tensor (ModelOpt) the same with one static scale each.

The quantizers agree bit for bit (the same float32 products with reciprocals, the same round-to-nearest-even cast);
the GEMMs then differ by float32 summation order only: 1e-6 relative (RMS) is ample, and a wrong block, scale or
group shows at 1e-2 and beyond.

The GPU paths (the Pallas kernels in interpret mode, the per-tensor XLA dot of e4m3 operands) are held to the reference
element by element. Both sum the same terms t_k = x8_k·s_x · w8_k·s_w in float32, in different orders: the reference
rounds the two dequantized operands and each product (3 roundings of 2^-24) and sums K terms; the kernel sums exact
e4m3 products per K block, scales each block sum (2 roundings) and adds ⌈K/128⌉ of them. First order, each result
is within (K + 3)·2^-24·Σ|t_k| of the exact sum, so the two are within twice that of each other. A wrong block, scale
or row shows as an error of the order of the terms themselves.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import _dispatch, dequantize_weight, fp8_grouped_matmul, fp8_matmul, quantize_activations
from pallas_kernels.fp8_matmul import _dequantized_input, _matmul_impl, quantize_weight
from pallas_kernels.fp8_matmul_pallas import default_tiles, suggested_split_k
from tests.fp8_bounds import TENSOR_CORE_BOUND, assert_within_summation_bound, fp8_gemms_run_on_tensor_cores
from tests.numerics import rms_relative_error

# The package re-exports the function under the module's name, so fetch the module itself.
fp8_matmul_module = importlib.import_module("pallas_kernels.fp8_matmul")

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = (128, 128)
# The most two bf16 roundings of one value can differ by, relative to the larger: one step of bf16's 8 significant
# bits, 2^-7 of a value at the bottom of its binade.
BF16_STEP = 2.0 ** -7
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
    want = numpy_tensor_gemm(x, w8, w_scale, input_scale)
    if fp8_gemms_run_on_tensor_cores():  # `auto` took cuBLASLt's e4m3 GEMM
        assert_within_summation_bound(got, want, summation_bound(x, w8, w_scale, None, input_scale,
                                                                 tensor_cores=True))
    else:
        assert rms_relative_error(got, want) < 1e-6


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
        fp8_matmul(x, w8, jnp.ones((2, 3)), block=BLOCK, impl="triton")


# ---- the GPU paths against the reference ---------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames="block")
def operands_as_seen(x, w8, w_scale, block, input_scale=None):
    """float32 (x, w) as the GEMM sees them: quantized and dequantized again. (Jitted, as every helper here that
    runs many small ops: one compilation is faster than each op's own.)"""
    return _dequantized_input(x, block, input_scale, False), dequantize_weight(w8, w_scale, block)


def summation_bound(x, w8, w_scale, block, input_scale=None, *, tensor_cores=False):
    """Per output element, from the operands as the GEMM sees them: 2(K + 3)·2^-24·Σ_k |t_k| where the e4m3 products
    are summed in float32 (see the module docstring), as the CPU does. With `tensor_cores` (a GPU runs every e4m3 dot
    on its FP8 tensor cores: the compiled kernels, cuBLASLt's GEMM, and the kernels' bodies in interpret mode too),
    whose accumulation keeps about 14 bits within each 128-term block (DeepSeek-V3 report §3.3.2), the sum is within
    about 2^-13·Σ|t_k| of the exact one: the bound is twice that, 2^-12·Σ|t_k|, still far below a wrong block's
    error."""
    xd, wd = (np.abs(np.asarray(a, np.float64)) for a in operands_as_seen(x, w8, w_scale, block, input_scale))
    return (TENSOR_CORE_BOUND if tensor_cores else 2 * (x.shape[1] + 3) * 2.0 ** -24) * (xd @ wd.T)


def grouped_summation_bound(x, w8, w_scale, block, input_scale, sizes, *, tensor_cores=False):
    """`summation_bound` of the routed rows, each group with its expert's weight and scales."""
    bounds, start = [np.zeros((0, w8.shape[1]))], 0
    for g, n in enumerate(np.asarray(sizes)):
        if n:
            bounds.append(summation_bound(x[start:start + n], w8[g], w_scale[g], block,
                                          None if input_scale is None else input_scale[g], tensor_cores=tensor_cores))
        start += n
    return np.concatenate(bounds)


@functools.partial(jax.jit, static_argnames=("block", "impl", "pow2", "options"))
def dense(x, w8, w_scale, input_scale=None, *, block, impl, pow2=False, options=()):
    """fp8_matmul jitted (kernels in interpret mode), so that cases of one shape share one compilation."""
    return fp8_matmul(x, w8, w_scale, block=block, input_scale=input_scale, pow2_scales=pow2, impl=impl,
                      interpret=True, **dict(options))


@functools.partial(jax.jit, static_argnames=("block", "impl", "byte_pairs"))
def grouped(x, w8, w_scale, sizes, input_scale=None, *, block, impl, byte_pairs=None):
    options = dict(byte_pairs=byte_pairs) if impl == "pallas" else {}
    return fp8_grouped_matmul(x, w8, w_scale, sizes, block=block, input_scale=input_scale, impl=impl,
                              interpret=True, block_m=16, **options)


@functools.partial(jax.jit, static_argnames=("shape", "block"))
def random_weight(key, shape, block):
    """FP8 weights quantized from normals scaled per row and per column by factors 1/8 .. 8: their block scales
    differ by up to 64x."""
    rows, cols = (2.0 ** jax.random.uniform(k, (n,), jnp.float32, -3, 3) for k, n in
                  zip(jax.random.split(key), shape[-2:]))
    return quantize_weight(jax.random.normal(key, shape) * rows[:, None] * cols, block)


KERNEL_SHAPES = [  # M, K, N, tile options
    (37, 256, 576, dict(block_m=16, block_n=64)),  # M past the last row tile; N = 4.5 scale blocks; 2 tiles per block
    (20, 320, 192, dict(block_m=16, block_n=256)),  # a partial last K block; a column tile over two scale blocks
    (5, 384, 130, dict()),  # default tiles; N two columns past a block
    # As channel pairs (the form of operands past 2^31 elements): a partial last K block of 32 pairs.
    (20, 320, 192, dict(block_m=16, block_n=64, byte_pairs=True)),
    # K split over programs: 7 K blocks in splits of 3, 3 and 1; a partial last K block in the last of two splits;
    # more splits asked than there are K blocks (one per block); with channel pairs.
    (5, 896, 192, dict(block_n=64, split_k=3)),
    (20, 320, 192, dict(block_m=16, block_n=64, split_k=2)),
    (3, 384, 130, dict(split_k=8)),
    (20, 320, 192, dict(block_m=16, block_n=64, byte_pairs=True, split_k=2)),
    (3, 1024, 192, {}),  # few output tiles over 8 K blocks: split in two by default (`_split_for`)
]


# The float32 summation bound holds where e4m3 dots sum in float32: on CPU. On a GPU even interpret mode runs the
# kernel bodies' e4m3 dots on the FP8 tensor cores (measured on the H200: 4.7-9x the float32 bound); there
# test_compiled_kernels_on_gpu holds the compiled kernels and the XLA e4m3 dot to the tensor cores' bound.
@pytest.mark.cpu_only
@pytest.mark.parametrize("M, K, N, options", KERNEL_SHAPES)
def test_block_kernel_equals_the_reference(M, K, N, options):
    keys = jax.random.split(jax.random.key(20 + M), 2)
    x = jax.random.normal(keys[0], (M, K)) * jnp.array([1.0, 30.0, 0.01])[(jnp.arange(K) // 128) % 3]
    w8, w_scale = random_weight(keys[1], (N, K), BLOCK)
    got = dense(x, w8, w_scale, block=BLOCK, impl="pallas", options=tuple(options.items()))
    want = dense(x, w8, w_scale, block=BLOCK, impl="xla")
    assert got.shape == (M, N) and got.dtype == x.dtype
    assert_within_summation_bound(got, want, summation_bound(x, w8, w_scale, BLOCK))


@pytest.mark.parametrize("rows, N, K", [(1, 576, 7168), (1, 1536, 7168), (1, 24576, 1536), (32, 7168, 16384),
                                        (1, 7168, 18432), (1, 128, 256), (4096, 18432, 7168)])
def test_suggested_split_k_fills_the_sms_with_splits_of_four_to_36_k_blocks(rows, N, K):
    split = suggested_split_k(rows, N, K, BLOCK, sms=132)
    tiles = default_tiles(rows)
    programs = -(-N // tiles["block_n"]) * -(-rows // tiles["block_m"])
    k_blocks = -(-K // 128)
    cap = 1 << (max(1, k_blocks // 4).bit_length() - 1)  # the most power-of-two splits of 4 K blocks or more
    assert split & (split - 1) == 0 and split <= cap
    assert (split == 1) == (programs >= 264 or cap == 1)  # two programs per SM from the tiles alone, or K short
    if split > 1:  # enough programs for two per SM and at most 36 K blocks per split, unless capped
        assert (programs * split >= 264 and k_blocks <= 36 * split) or split == cap
        half = split // 2  # and no more than that: half the splits miss one of the two
        assert programs * half < 264 or k_blocks > 36 * half


def test_block_kernel_with_pow2_scales_and_bf16_activations():
    """Output in bf16: both round float32 sums which lie within the bound of each other, so they differ by at most one
    bf16 step (BF16_STEP of the larger value) beyond it."""
    keys = jax.random.split(jax.random.key(30), 2)
    x = jax.random.normal(keys[0], (24, 256)).astype(jnp.bfloat16)
    w8, w_scale = random_weight(keys[1], (128, 256), BLOCK)
    got = dense(x, w8, w_scale, block=BLOCK, impl="pallas", pow2=True)
    want = dense(x, w8, w_scale, block=BLOCK, impl="xla", pow2=True)
    assert got.dtype == jnp.bfloat16
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = summation_bound(x, w8, w_scale, BLOCK) + BF16_STEP * np.maximum(abs(got64), abs(want64))
    assert_within_summation_bound(got64, want64, bound)


@pytest.mark.cpu_only
@pytest.mark.parametrize("impl", ["pallas", "xla_fp8"])
def test_per_tensor_gpu_paths_equal_the_reference(impl):
    """xla_fp8 is one XLA dot of two e4m3 operands, which the CPU runs too."""
    M, K, N = 21, 320, 192
    keys = jax.random.split(jax.random.key(31), 2)
    x = jax.random.normal(keys[0], (M, K)) * 3
    w8, w_scale = random_weight(keys[1], (N, K), None)
    input_scale = jnp.float32(0.005)  # ±2.24: the largest inputs saturate
    got = dense(x, w8, w_scale, input_scale, block=None, impl=impl)
    want = dense(x, w8, w_scale, input_scale, block=None, impl="xla")
    assert_within_summation_bound(got, want, summation_bound(x, w8, w_scale, None, input_scale))


GROUPED_SIZES = [
    [7, 0, 20, 5],  # an empty expert, groups straddling 16-row tiles, 8 rows past the total
    [0, 0, 0, 0],  # nothing routed: all zeros
    [40, 0, 0, 0],  # one expert takes every row
]


@pytest.mark.cpu_only
@pytest.mark.parametrize("sizes", GROUPED_SIZES)
@pytest.mark.parametrize("block, byte_pairs", [(BLOCK, None), (None, None), (BLOCK, True)])
def test_grouped_kernel_equals_the_reference(sizes, block, byte_pairs):
    E, M, K, N = 4, 40, 256, 192
    keys = jax.random.split(jax.random.key(32), 2)
    x = jax.random.normal(keys[0], (M, K))
    w8, w_scale = random_weight(keys[1], (E, N, K), block)
    input_scale = None if block else jnp.array([0.004, 0.008, 0.002, 0.01], jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = grouped(x, w8, w_scale, sizes, input_scale, block=block, impl="pallas", byte_pairs=byte_pairs)
    want = grouped(x, w8, w_scale, sizes, input_scale, block=block, impl="xla")
    total = int(sizes.sum())
    assert_within_summation_bound(got[:total], want[:total],
                                  grouped_summation_bound(x, w8, w_scale, block, input_scale, sizes))
    assert not np.asarray(got[total:]).any()  # the kernel writes the rows past the total itself


def test_byte_pairs_only_where_32_bit_offsets_overflow():
    """1-byte operands of 2^31 .. 2^32 elements (DeepSeek-V3's 256 x 7168 x 2048 down projection on one device) go
    in as channel pairs; smaller ones, and larger ones (which the lowering addresses with 64-bit offsets), do not."""
    from pallas_kernels.fp8_matmul_pallas import as_byte_pairs, needs_byte_pairs

    S, f8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
    assert needs_byte_pairs(S((256, 7168, 2048), f8))
    assert not needs_byte_pairs(S((256, 4096, 7168), f8), S((32, 7168, 2048), f8), S((256, 7168, 2048), jnp.bfloat16))
    x = jnp.asarray([[1.0, -2.0, 0.5, 448.0]], f8)
    pairs = np.asarray(as_byte_pairs(x))
    assert pairs.shape == (1, 2) and pairs.dtype == np.uint16
    assert [(p & 0xFF, p >> 8) for p in pairs[0]] == [tuple(np.asarray(x).view(np.uint8)[0, i:i + 2]) for i in (0, 2)]


def test_weight_quantization_round_trips_within_half_an_e4m3_step():
    w = jax.random.normal(jax.random.key(33), (2, 200, 300))
    for block in [BLOCK, None]:
        w8, scale = quantize_weight(w, block)
        assert scale.shape == ((2, 2, 3) if block else (2,))
        back = np.asarray(dequantize_weight(w8, scale, block), np.float64)
        assert (np.abs(back - np.asarray(w)) <= 2.0 ** -4 * np.abs(np.asarray(w)) + 2.0 ** -10 * float(
            np.asarray(scale).max())).all()
    assert np.abs(np.asarray(quantize_weight(w, BLOCK)[0], np.float32)).max() == 448


def test_auto_runs_the_reference_on_a_gpu_with_the_gpu_paths_switched_off(monkeypatch):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(fp8_matmul_module, "GPU_PATHS_VERIFIED", False)
    assert _matmul_impl("auto", BLOCK, interpret=False) == "xla"
    assert _matmul_impl("auto", None, interpret=False) == "xla"
    assert _matmul_impl("pallas", BLOCK, interpret=False) == "pallas"


def test_auto_picks_the_gpu_paths_on_a_gpu(monkeypatch):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(fp8_matmul_module, "GPU_PATHS_VERIFIED", True)
    assert _matmul_impl("auto", BLOCK, interpret=False) == "pallas"
    assert _matmul_impl("auto", None, interpret=False) == "xla_fp8"  # cuBLASLt's FP8 GEMM
    assert _matmul_impl("auto", (128, 96), interpret=False) == "xla"  # a K step Triton cannot tile
    with pytest.raises(ValueError, match="block\\[1\\]"):
        _matmul_impl("pallas", (128, 96), interpret=False)
    with pytest.raises(ValueError, match="per-tensor"):
        _matmul_impl("xla_fp8", BLOCK, interpret=False)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6)])
def test_auto_runs_the_reference_on_a_gpu_without_fp8_tensor_cores(monkeypatch, caplog, capability):
    """An A100 (8.0) or an RTX 3090 (8.6) has no e4m3 MMA: `auto` serves FP8 weights through the reference (the
    weights dequantized in the step), block-scaled and per-tensor, dense and grouped; an explicit impl is left as asked.
    Ada (8.9) takes the GPU paths."""
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(_dispatch, "gpu_capability", lambda: capability)
    monkeypatch.setattr(fp8_matmul_module, "GPU_PATHS_VERIFIED", True)
    fp8_matmul_module._warn_no_fp8_tensor_cores.cache_clear()
    with caplog.at_level("WARNING", logger="pallas_kernels"):
        assert _matmul_impl("auto", BLOCK, interpret=False) == "xla"
    assert f"compute capability {capability[0]}.{capability[1]}" in caplog.text and "dequantize" in caplog.text
    assert _matmul_impl("auto", None, interpret=False) == "xla"
    assert _matmul_impl("pallas", BLOCK, interpret=False) == "pallas"
    keys = jax.random.split(jax.random.key(36), 3)
    x = jax.random.normal(keys[0], (24, 256))
    w8, w_scale = random_weight(keys[1], (4, 128, 256), BLOCK)
    sizes = jnp.array([5, 0, 12, 7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x, w8[0], w_scale[0], block=BLOCK)),
                                  np.asarray(fp8_matmul(x, w8[0], w_scale[0], block=BLOCK, impl="xla")))
    np.testing.assert_array_equal(
        np.asarray(fp8_grouped_matmul(x, w8, w_scale, sizes, block=BLOCK)),
        np.asarray(fp8_grouped_matmul(x, w8, w_scale, sizes, block=BLOCK, impl="xla")))
    monkeypatch.setattr(_dispatch, "gpu_capability", lambda: (8, 9))
    assert _matmul_impl("auto", BLOCK, interpret=False) == "pallas"
    assert _matmul_impl("auto", None, interpret=False) == "xla_fp8"


def test_auto_keeps_the_hopper_kernels_on_hoppers(monkeypatch):
    """The Mosaic kernel (wgmma) and cuBLASLt's block-scaled GEMM (measured on the H200 only) are Hopper paths: a
    Blackwell (10.0) or an Ada (8.9) keeps the Triton kernel."""
    from pallas_kernels.fp8_matmul import _auto_takes_cublaslt, _auto_takes_mosaic

    monkeypatch.setattr(fp8_matmul_module, "BLOCK_KERNEL", "mosaic")
    monkeypatch.setattr(fp8_matmul_module, "USE_CUBLASLT", True)
    monkeypatch.setattr(fp8_matmul_module, "_one_device", lambda: True)
    for capability, hopper in [((9, 0), True), ((10, 0), False), ((8, 9), False), (None, True)]:
        monkeypatch.setattr(_dispatch, "gpu_capability", lambda c=capability: c)
        assert _auto_takes_mosaic("auto", "pallas", BLOCK, (256, 7168), interpret=False) == hopper
        assert _auto_takes_cublaslt("auto", "pallas", BLOCK, (256, 7168), interpret=False) == hopper


def test_auto_hands_block_scaled_weights_to_the_mosaic_kernel_per_block_kernel(monkeypatch):
    from pallas_kernels.fp8_matmul import _auto_takes_mosaic

    monkeypatch.setattr(fp8_matmul_module, "BLOCK_KERNEL", "mosaic")
    assert _auto_takes_mosaic("auto", "pallas", BLOCK, (256, 7168), interpret=False)
    assert not _auto_takes_mosaic("auto", "pallas", BLOCK, (576, 7168 + 64), interpret=False)  # K not in blocks
    assert not _auto_takes_mosaic("auto", "pallas", BLOCK, (256, 7168), interpret=True)
    assert not _auto_takes_mosaic("pallas", "pallas", BLOCK, (256, 7168), interpret=False)  # asked for Triton
    assert not _auto_takes_mosaic("auto", "xla", BLOCK, (256, 7168), interpret=False)  # the reference's turn
    monkeypatch.setattr(fp8_matmul_module, "BLOCK_KERNEL", "pallas")
    assert not _auto_takes_mosaic("auto", "pallas", BLOCK, (256, 7168), interpret=False)


@pytest.mark.parametrize("use_cublaslt", [True, False])
def test_auto_picks_the_dense_kernel_by_rows(monkeypatch, use_cublaslt):
    """On a GPU with the Mosaic kernels chosen, a dense product of fewer than MOSAIC_MIN_ROWS rows (decode) runs the
    Triton kernel, from MOSAIC_MIN_ROWS rows the Mosaic one, from CUBLASLT_MIN_ROWS (prefill) cuBLASLt's GEMM unless
    JAXMODELS_FP8_CUBLASLT=0 or several devices (kernels replaced by recorders: no GPU here)."""
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(fp8_matmul_module, "GPU_PATHS_VERIFIED", True)
    monkeypatch.setattr(fp8_matmul_module, "BLOCK_KERNEL", "mosaic")
    monkeypatch.setattr(fp8_matmul_module, "USE_CUBLASLT", use_cublaslt)
    monkeypatch.setattr(fp8_matmul_module, "_one_device", lambda: True)
    ran = []
    monkeypatch.setattr(fp8_matmul_module, "_mosaic_matmul", lambda x, *a, **k: ran.append("mosaic") or x)
    monkeypatch.setattr(fp8_matmul_module, "_cublaslt_matmul", lambda x, *a, **k: ran.append("cublaslt") or x)
    monkeypatch.setattr(fp8_matmul_module, "fp8_block_matmul", lambda x8, *a, **k: ran.append("triton") or x8)
    w8, w_scale = random_weight(jax.random.key(0), (256, 256), BLOCK)
    mosaic, cublaslt = fp8_matmul_module.MOSAIC_MIN_ROWS, fp8_matmul_module.CUBLASLT_MIN_ROWS
    for rows in [1, mosaic - 1, mosaic, cublaslt - 1, cublaslt, 4096]:
        fp8_matmul(jnp.ones((rows, 256)), w8, w_scale, block=BLOCK)
    large = "cublaslt" if use_cublaslt else "mosaic"
    assert ran == ["triton", "triton", "mosaic", "mosaic", large, large]
    ran.clear()  # a weight cuBLASLt cannot take (N not a multiple of 16) stays on the kernels
    w8_odd, w_scale_odd = random_weight(jax.random.key(0), (200, 256), BLOCK)
    fp8_matmul(jnp.ones((4096, 256)), w8_odd, w_scale_odd, block=BLOCK)
    monkeypatch.setattr(fp8_matmul_module, "_one_device", lambda: False)  # so does a mesh (no sharding rule)
    fp8_matmul(jnp.ones((4096, 256)), w8, w_scale, block=BLOCK)
    assert ran == ["triton", "mosaic"]


def test_cublaslt_scale_layouts():
    """The scales as cuBLASLt reads them: the activations' transposed ([K blocks][rows], rows padded to the row
    multiple with zeros), the weight's as stored with its K blocks padded to a multiple of 4."""
    from pallas_kernels.fp8_matmul_cublaslt import cublaslt_problem, laid_out_scales

    x_scale = jnp.arange(5 * 3, dtype=jnp.float32).reshape(5, 3)
    w_scale = 100 + jnp.arange(2 * 3, dtype=jnp.float32).reshape(2, 3)
    xs, ws = laid_out_scales(x_scale, w_scale, rows=8)
    assert xs.shape == (3, 8) and ws.shape == (2, 4)
    np.testing.assert_array_equal(xs[:, :5], x_scale.T)
    assert not np.asarray(xs[:, 5:]).any()
    np.testing.assert_array_equal(ws[:, :3], w_scale)
    assert cublaslt_problem(576, 7168, BLOCK) is None
    assert "multiples of 16" in cublaslt_problem(200, 7168, BLOCK)
    assert "(128, 128)" in cublaslt_problem(256, 256, (128, 64))


@pytest.mark.cpu_only
def test_cublaslt_asked_for_on_the_cpu_is_a_clear_error():
    """impl='cublaslt' off the GPU fails at trace time, naming why, not inside the callback."""
    with pytest.raises(ValueError, match="NVIDIA GPUs only"):
        fp8_matmul(jnp.ones((4, 256)), *random_weight(jax.random.key(0), (256, 256), BLOCK), block=BLOCK,
                   impl="cublaslt")


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: False)
    assert _matmul_impl("auto", BLOCK, interpret=False) == "xla"
    assert _matmul_impl("auto", None, interpret=False) == "xla"
    assert _matmul_impl("auto", None, interpret=True) == "pallas"


def test_kernels_lower_to_triton_at_deepseek_shapes(cuda_lowering):
    """The Pallas-to-Triton lowering (run here without a GPU) takes e4m3 dots, the masked and partial edges, the
    gathered column scales and K split over programs (loop bounds from the program id). That Triton then compiles
    them is the GPU test's and bench/fp8_kernels.py --check's."""
    S, f8 = jax.ShapeDtypeStruct, jnp.float8_e4m3fn
    for M, K, N, options in [(4096, 7168, 18432, {}), (16, 7168, 576, {}), (300, 1536, 576, dict(block_n=256)),
                             (7, 200, 130, {}), (1, 7168, 576, dict(split_k=8))]:
        dense = jax.jit(lambda x, w, s: fp8_matmul(x, w, s, block=BLOCK, impl="pallas", **options))
        cuda_lowering(dense, S((M, K), jnp.bfloat16), S((N, K), f8), S((-(-N // 128), -(-K // 128)), jnp.float32))
    grouped = jax.jit(lambda x, w, s, g: fp8_grouped_matmul(x, w, s, g, block=BLOCK, impl="pallas"))
    cuda_lowering(grouped, S((2048, 7168), jnp.bfloat16), S((256, 2048, 7168), f8), S((256, 16, 56), jnp.float32),
                  S((256,), jnp.int32))
    # The down projection of one device's 256 experts: past 2^31 e4m3 elements, as channel pairs.
    cuda_lowering(grouped, S((2048, 2048), jnp.bfloat16), S((256, 7168, 2048), f8), S((256, 56, 16), jnp.float32),
                  S((256,), jnp.int32))
    per_tensor = jax.jit(lambda x, w, s, i, g: fp8_grouped_matmul(x, w, s, g, block=None, input_scale=i,
                                                                   impl="pallas"))
    cuda_lowering(per_tensor, S((64, 2688), jnp.bfloat16), S((8, 1856, 2688), f8), S((8,), jnp.float32),
                  S((8,), jnp.float32), S((8,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("block, byte_pairs", [(BLOCK, None), (None, None), (BLOCK, True)])
def test_compiled_kernels_on_gpu(block, byte_pairs):
    """The compiled kernels (and, per-tensor, cuBLASLt's e4m3 GEMM) held to the FP8 tensor cores' bound,
    `summation_bound(tensor_cores=True)`."""
    M, K, N, E = 300, 1024, 576, 4
    keys = jax.random.split(jax.random.key(34), 2)
    x = jax.random.normal(keys[0], (M, K))
    w8, w_scale = random_weight(keys[1], (E, N, K), block)
    input_scale = None if block else jnp.array([0.004, 0.008, 0.002, 0.01], jnp.float32)
    sizes = jnp.array([100, 0, 150, 30], jnp.int32)
    options = dict(block=block, input_scale=input_scale)
    got = jax.jit(lambda *a: fp8_grouped_matmul(*a, impl="pallas", byte_pairs=byte_pairs, **options))(
        x, w8, w_scale, sizes)
    want = fp8_grouped_matmul(x, w8, w_scale, sizes, impl="xla", **options)
    bound = grouped_summation_bound(x, w8, w_scale, block, input_scale, sizes, tensor_cores=True)
    assert_within_summation_bound(got[:280], want[:280], bound)
    assert not np.asarray(got[280:]).any()
    if block:  # dense, with a partial last K block (zero-filled e4m3 loads), and with K split over programs
        for k, split_k in [(K, 1), (200, 1), (K, 3)]:
            operands = (x[:, :k], w8[0, :, :k], w_scale[0, :, :-(-k // 128)])
            got = jax.jit(lambda *a: fp8_matmul(*a, block=BLOCK, impl="pallas", byte_pairs=byte_pairs,
                                                split_k=split_k))(*operands)
            want = fp8_matmul(*operands, block=BLOCK, impl="xla")
            assert_within_summation_bound(got, want, summation_bound(*operands, BLOCK, tensor_cores=True))
        for rows, k, dtype in [(M, K, jnp.float32), (1, K, jnp.float32), (7, 256, jnp.bfloat16)]:
            # cuBLASLt's block-scaled GEMM (rows padded to 4, K blocks of the scales to 4), float32 and bf16 out
            operands = (x[:rows, :k].astype(dtype), w8[1, :, :k], w_scale[1, :, :k // 128])
            got = jax.jit(lambda *a: fp8_matmul(*a, block=BLOCK, impl="cublaslt"))(*operands)
            want = fp8_matmul(*operands, block=BLOCK, impl="xla")
            if dtype == jnp.float32:
                assert_within_summation_bound(got, want, summation_bound(*operands, BLOCK, tensor_cores=True))
            else:  # the output's bf16 rounding on top: 2^-8 of each value
                np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                           rtol=2 ** -7, atol=2 ** -7 * float(jnp.abs(want.astype(jnp.float32)).max()))
    else:  # per-tensor dense: cuBLASLt's e4m3 GEMM (impl xla_fp8), float32 accumulation asked for; one row too
        for rows in (M, 1, 2):  # (a decode step at one sequence, which XLA would make a vector-matrix product)
            operands = (x[:rows], w8[2], w_scale[2])
            got = jax.jit(lambda *a: fp8_matmul(*a, block=None, input_scale=input_scale[2], impl="xla_fp8"))(
                *operands)
            want = fp8_matmul(*operands, block=None, input_scale=input_scale[2], impl="xla")
            assert_within_summation_bound(got, want, summation_bound(*operands, None, input_scale[2],
                                                                     tensor_cores=True))


@pytest.mark.gpu
def test_auto_runs_prefill_rows_on_cublaslt_on_gpu(monkeypatch):
    """`auto` at CUBLASLT_MIN_ROWS bf16 rows (a prefill chunk) on one GPU takes cuBLASLt's block-scaled GEMM, inside a
    jitted step with work fused on both sides of it, and stays within the tensor cores' summation bound plus one bf16
    step (at most 2^-7 of the value) of the reference: both round sums within the bound to bf16.

    (An elementwise tolerance on the values does not hold: with weights scaled by up to 8 per row and column, the sums
    reach 6,500 while 0.7% of the outputs are below 1, and those carry the accumulation error of their large terms:
    0.2 on 0.9 in the first run on the H200, 3e-5 of the largest output.)"""
    ran = []
    real = fp8_matmul_module._cublaslt_matmul
    monkeypatch.setattr(fp8_matmul_module, "_cublaslt_matmul", lambda *a: ran.append(True) or real(*a))
    rows, K, N = fp8_matmul_module.CUBLASLT_MIN_ROWS, 1536, 576
    keys = jax.random.split(jax.random.key(35), 2)
    x = jax.random.normal(keys[0], (rows, K), jnp.bfloat16) * 2  # x * 2 and / 2 are exact in bf16
    w8, w_scale = random_weight(keys[1], (N, K), BLOCK)
    step = jax.jit(lambda a, w, s: fp8_matmul(a * 2, w, s, block=BLOCK).astype(jnp.float32) / 2)
    got = step(x / 2, w8, w_scale)
    assert ran == ([True] if jax.device_count() == 1 else [])
    want = fp8_matmul(x, w8, w_scale, block=BLOCK, impl="xla")
    assert got.dtype == jnp.float32 and want.dtype == jnp.bfloat16
    got64, want64 = np.asarray(got, np.float64) * 2, np.asarray(want, np.float64)
    bound = summation_bound(x, w8, w_scale, BLOCK, tensor_cores=True) + BF16_STEP * np.maximum(abs(got64), abs(want64))
    assert_within_summation_bound(got64, want64, bound)
