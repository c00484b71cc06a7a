"""The Mosaic GPU FP8 block GEMM (`pallas_kernels.fp8_matmul_mosaic`, compiled on jax >= 0.11) against the XLA
reference: in Mosaic GPU's interpreter on CPU (with clusters on jax >= 0.11 only) held to the float32 summation bound
of test_fp8_matmul, compiled on the GPU to the FP8 tensor cores' bound; its lowering for an H200 at DeepSeek's shapes
(jax 0.10 too); and its order of work (any jax).

With clusters of two CTAs (`cluster=2`) the interpreter checks the split of the work (both CTAs on one column tile,
each on its own row tile) but not the multicast of w's tiles, which it copies into each CTA on its own: that is
left to the lowering (a legal split of the TMA copy) and to the compiled test on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_matmul import fp8_grouped_matmul, fp8_matmul, quantize_activations
from pallas_kernels.fp8_matmul_mosaic import (_is_routed, _work_tile, fp8_block_grouped_matmul_mosaic,
                                              fp8_block_matmul_mosaic)
from pallas_kernels.grouped_matmul import make_schedule
from tests.fp8_bounds import assert_within_summation_bound
from tests.mosaic_interpreter import run_race_checked
from tests.mosaic_marks import needs_mosaic, needs_mosaic_lowering
from tests.pallas_kernels.test_fp8_matmul import BLOCK, grouped_summation_bound, random_weight, summation_bound



@pytest.mark.parametrize("sizes", [[3, 0, 300, 1], [0, 0, 0, 0], [128, 128, 0, 0], [0, 0, 0, 5]])
def test_schedule_lists_routed_items_first(sizes):
    """The kernel visits only the first `routed` items of `make_schedule` (no check per item): the routed ones must
    come before the tail's and the padding, whatever the sizes."""
    expert = np.asarray(make_schedule(jnp.asarray(sizes, jnp.int32), 512, 128)[0])
    routed = np.asarray(_is_routed(expert, len(sizes)))
    assert routed.tolist() == sorted(routed.tolist(), reverse=True)


@pytest.mark.parametrize("items, routed, group", [(32, 32, 16), (5, 5, 2), (257, 8, 16), (10, 0, 4), (7, 7, 16)])
def test_work_order_visits_each_routed_tile_once_in_groups(items, routed, group):
    """The persistent loop's work indices 0 .. routed x columns map onto every (routed item, column tile) once, the
    column the slow index within each group of items (the last group short); items past `routed` never come up."""
    columns, group = 3, max(1, min(group, items))
    item, column = (np.asarray(a) for a in jax.vmap(
        lambda w: _work_tile(w, jnp.int32(routed), columns, group))(jnp.arange(routed * columns)))
    assert sorted(zip(item.tolist(), column.tolist())) == [(i, c) for i in range(routed) for c in range(columns)]
    for first in range(0, routed, group):
        last = min(first + group, routed)
        span = slice(first * columns, last * columns)
        assert (np.diff(column[span]) >= 0).all() and set(item[span].tolist()) == set(range(first, last))


def operands(M, K, N, seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (M, K)) * jnp.array([1.0, 30.0, 0.01])[(jnp.arange(K) // 128) % 3]
    w8, w_scale = random_weight(keys[1], (N, K), BLOCK)
    return x, w8, w_scale


def with_clusters(*values):
    """A case with clusters: jax 0.10's interpreter has no rule for the cluster barrier (jax 0.11's has)."""
    return pytest.param(*values, marks=needs_mosaic)


@needs_mosaic_lowering
@pytest.mark.cpu_only
@pytest.mark.parametrize("M, K, N, tiles, programs", [(128, 384, 384, dict(tile_m=64), 2),
                                                      (256, 256, 128, dict(tile_m=64), 3),
                                                      (512, 256, 384, dict(tile_m=64, group_items=3), 2),
                                                      with_clusters(768, 256, 384, dict(tile_m=64, group_items=4,
                                                                                        cluster=2), 4),
                                                      with_clusters(256, 256, 128, dict(tile_m=64, cluster=2), 6),
                                                      with_clusters(512, 384, 256, dict(tile_m=64, cluster=2), 2)])
def test_interpreted_kernel_equals_the_reference(M, K, N, tiles, programs):
    """Several output tiles per program (a persistent loop over fewer programs than tiles) or an idle program, row
    tiles swept in groups (the last one short), several K steps with scales 1/8..8 per block and activations spanning
    1e-2..30 per 128 channels. With clusters of two: 3 row tile pairs in groups of 2 pairs (the last short) x 3
    column tiles over 2 clusters, 1 pair over 3 clusters (2 idle), 2 pairs x 2 column tiles over 2 clusters."""
    x, w8, w_scale = operands(M, K, N, M + N)
    x8, x_scale = quantize_activations(x, 128)
    got = run_race_checked(fp8_block_matmul_mosaic, x8, x_scale, w8, w_scale, out_dtype=jnp.float32,
                           num_programs=programs, **tiles)
    want = fp8_matmul(x, w8, w_scale, block=BLOCK, impl="xla")
    assert_within_summation_bound(got, want, summation_bound(x, w8, w_scale, BLOCK))


@needs_mosaic_lowering
@pytest.mark.cpu_only
@pytest.mark.parametrize("options", [{}, with_clusters(dict(cluster=2))])
def test_fp8_matmul_takes_the_mosaic_kernel_on_any_rows(options):
    """impl="mosaic" through fp8_matmul: 100 rows, padded to the kernel's 128-row tile (a pair of them with
    clusters) and cut back, bf16 in and out (both sides round float32 sums within the bound to bf16: beyond it they
    may differ by one bf16 step, at most 2^-7 of the value)."""
    x, w8, w_scale = operands(100, 256, 256, 7)
    x = x.astype(jnp.bfloat16)
    got = fp8_matmul(x, w8, w_scale, block=BLOCK, impl="mosaic", interpret=True, num_programs=2, **options)
    want = fp8_matmul(x, w8, w_scale, block=BLOCK, impl="xla")
    assert got.shape == (100, 256) and got.dtype == jnp.bfloat16
    bound = summation_bound(x, w8, w_scale, BLOCK) + 2.0 ** -7 * np.abs(np.asarray(want, np.float64))
    assert_within_summation_bound(got, want, bound)
    with pytest.raises(ValueError, match="takes \\(128, 128\\) block-scaled weights"):
        fp8_matmul(x, w8, w_scale[0, 0], block=None, input_scale=jnp.float32(1), impl="mosaic")


@needs_mosaic_lowering
@pytest.mark.cpu_only
@pytest.mark.parametrize("sizes", [[100, 0, 150, 30], [0, 0, 0, 0], [300, 0, 0, 0]])
def test_interpreted_grouped_kernel_equals_the_reference(sizes):
    """Experts sharing row tiles (each item writes its own block, each row is gathered from its item), an empty
    expert, 20 rows past the total (zeros), 300 rows padded to the 128-row tile."""
    E, M, K, N = 4, 300, 256, 256
    keys = jax.random.split(jax.random.key(8), 2)
    x = jax.random.normal(keys[0], (M, K))
    w8, w_scale = random_weight(keys[1], (E, N, K), BLOCK)
    sizes = jnp.asarray(sizes, jnp.int32)
    x8, x_scale = quantize_activations(x, 128)
    got = run_race_checked(fp8_block_grouped_matmul_mosaic, x8, x_scale, w8, w_scale, sizes, out_dtype=jnp.float32,
                           num_programs=3)
    want = fp8_grouped_matmul(x, w8, w_scale, sizes, block=BLOCK, impl="xla")
    total = int(sizes.sum())
    assert_within_summation_bound(got[:total], want[:total],
                                  grouped_summation_bound(x, w8, w_scale, BLOCK, None, sizes))
    assert not np.asarray(got[total:]).any()
    through_fp8 = fp8_grouped_matmul(x, w8, w_scale, sizes, block=BLOCK, impl="mosaic", interpret=True,
                                     num_programs=3)
    np.testing.assert_array_equal(np.asarray(through_fp8), np.asarray(got))


def test_clusters_are_refused_where_the_kernel_cannot_take_them():
    """Rows that do not fill a pair of row tiles, clusters other than pairs, and the grouped kernel (whose schedule
    does not pair items of one expert): a ValueError before anything is traced, on any jax."""
    x8, x_scale = jnp.zeros((384, 256), jnp.float8_e4m3fn), jnp.ones((384, 2), jnp.float32)
    w8, w_scale = jnp.zeros((128, 256), jnp.float8_e4m3fn), jnp.ones((1, 2), jnp.float32)
    with pytest.raises(ValueError, match="M=384 must be a multiple of 256"):
        fp8_block_matmul_mosaic(x8, x_scale, w8, w_scale, cluster=2)
    with pytest.raises(ValueError, match="clusters of \\(1, 2\\) CTAs"):
        fp8_block_matmul_mosaic(x8, x_scale, w8, w_scale, cluster=3)
    with pytest.raises(ValueError, match="grouped Mosaic kernel runs without clusters"):
        fp8_block_grouped_matmul_mosaic(x8, x_scale, w8[None], w_scale[None], jnp.array([384], jnp.int32), cluster=2)


@needs_mosaic_lowering
def test_kernel_lowers_for_the_h200_at_deepseek_shapes():
    """Mosaic GPU's lowering (layouts, swizzles, shared memory, and with clusters the multicast of w's tile split
    between the two CTAs) of the dense up projection's shape, without a GPU."""
    S = jax.ShapeDtypeStruct
    M, K, N = 4096, 7168, 18432
    for tiles in [dict(tile_m=64), dict(tile_m=128, steps_in_flight=3), dict(tile_m=64, cluster=2),
                  dict(tile_m=64, steps_in_flight=5, cluster=2)]:
        f = jax.jit(lambda a, s, b, t: fp8_block_matmul_mosaic(a, s, b, t, num_programs=132, **tiles))
        jax.export.export(f, platforms=["cuda"])(S((M, K), jnp.float8_e4m3fn), S((M, K // 128), jnp.float32),
                                                 S((N, K), jnp.float8_e4m3fn), S((N // 128, K // 128), jnp.float32))
    # The routed experts of one device holding all 256 (3.76 G e4m3 elements), a 4096-token prefill's 32768 rows.
    E, M, K, N = 256, 32768, 7168, 2048
    g = jax.jit(lambda a, s, b, t, n: fp8_block_grouped_matmul_mosaic(a, s, b, t, n, num_programs=132))
    jax.export.export(g, platforms=["cuda"])(S((M, K), jnp.float8_e4m3fn), S((M, K // 128), jnp.float32),
                                             S((E, N, K), jnp.float8_e4m3fn), S((E, N // 128, K // 128), jnp.float32),
                                             S((E,), jnp.int32))


@needs_mosaic
@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(cluster=2), dict(cluster=2, num_programs=4, group_items=2)])
def test_compiled_kernel_on_gpu(options):
    """Without clusters and with pairs (one work unit per cluster at most, or six per cluster in groups of one
    pair)."""
    x, w8, w_scale = operands(512, 1024, 768, 5)
    x8, x_scale = quantize_activations(x, 128)
    got = jax.jit(lambda *a: fp8_block_matmul_mosaic(*a, out_dtype=jnp.float32, **options))(x8, x_scale, w8, w_scale)
    want = fp8_matmul(x, w8, w_scale, block=BLOCK, impl="xla")
    assert_within_summation_bound(got, want, summation_bound(x, w8, w_scale, BLOCK, tensor_cores=True))


@needs_mosaic
@pytest.mark.gpu
def test_compiled_grouped_kernel_on_gpu():
    E, M, K, N = 4, 300, 1024, 512
    keys = jax.random.split(jax.random.key(9), 2)
    x = jax.random.normal(keys[0], (M, K))
    w8, w_scale = random_weight(keys[1], (E, N, K), BLOCK)
    sizes = jnp.array([100, 0, 150, 30], jnp.int32)
    got = jax.jit(lambda *a: fp8_grouped_matmul(*a, block=BLOCK, impl="mosaic"))(x, w8, w_scale, sizes)
    want = fp8_grouped_matmul(x, w8, w_scale, sizes, block=BLOCK, impl="xla")
    bound = grouped_summation_bound(x, w8, w_scale, BLOCK, None, sizes, tensor_cores=True)
    assert_within_summation_bound(got[:280], want[:280], bound)
    assert not np.asarray(got[280:]).any()
