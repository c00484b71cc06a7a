"""Block-scaled FP8 GEMM for Hopper through Pallas' Mosaic GPU backend: wgmma on e4m3 operands, TMA loads by a
producer warpgroup, two consumer warpgroups (work in progress, issue 15).

`fp8_block_matmul_mosaic(x8[M, K], x_scale[M, K/128], w8[N, K], w_scale[N/128, K/128]) -> [M, N]`: the semantics of
`fp8_matmul_pallas.fp8_block_matmul` with block (128, 128).

Why another kernel: the Triton-lowered one reaches 349 TFLOP/s on the H200 at M = 4096, K = 7168, N = 18432, half of
bf16 (`docs/BENCHMARKS.md`), while cuBLASLt's e4m3 GEMM reaches 1,337 on the same shape. Each 128-wide K step's
product must be scaled (x's row scales times w's block scale) and added to a float32 total before the next, and in
the Triton lowering nothing overlaps that promotion with the tensor cores. Here a producer warpgroup streams x and w
tiles (and their scales) into shared memory through TMA, `steps_in_flight` steps ahead, and two consumer warpgroups
each own half of a [2 * tile_m, 128] output tile: while one scales its product, the other's wgmma runs.

Per K step, per consumer: a wgmma of its [tile_m, 128] x tile and the [128, 128] w tile (w is stored [N, K],
K-major, as e4m3 wgmma wants its B operand, and read through a transposed view) into a fresh accumulator, then
total += product * (x_scale[rows] * w_scale[block]) in registers, one multiply-add per element (DeepSeek-V3's
promotion: the FP8 MMA's reduced accumulator precision is confined to 128-term chains). The column tile is one
scale block wide, so w's scale is a scalar per step. Wider column tiles (two 128-column blocks) or two row tiles per
consumer need two float32 accumulators of 128 registers a thread each and spilled (397 and 418 TFLOP/s on the H200
where this tile reached 682, before the scalar scale and the grouped sweep). The output tiles are handed out by a
persistent loop over the SMs, in groups of row tiles that share each column tile of w (`_work_tile`).

Clusters (`cluster=2`, dense only, opt-in): each CTA loads a [2 * tile_m, 128] x tile and a [128, 128] w tile from
L2 per K step, 32 KB at tile_m = 64, ~8 TB/s over the SMs at the H200's 1.08 ms for DeepSeek's up projection: the
suspected limit. DeepGEMM's remedy: the two CTAs of a cluster compute consecutive row tiles (a work unit) against
the same column tile at every iteration of the persistent loop, and w's tile is multicast (each CTA's TMA loads
half of it into both CTAs' shared memory), 24 KB from L2 per CTA and step. A pipeline slot is then released
through a cluster barrier, refilled only once the consumers of both CTAs are done with it (the peer writes into it
too), so the two CTAs stay within `steps_in_flight` steps of each other.

Shapes: M a multiple of cluster * 2 * tile_m (`row_multiple`), N and K of 128 (the wrapper in `fp8_matmul` pads
M). Runs on jax >= 0.11 (Pallas Mosaic GPU with warpgroup semantics; jax 0.10 lowers it too, which the CPU tests
check); `interpret=True` runs it on CPU in Mosaic GPU's interpreter (which copies a multicast tile into each CTA on
its own: it checks the work split, not the multicast).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._dispatch import num_sms
from ._mosaic import interpret_option, kernel_ops, mosaic_gpu

BLOCK = 128  # the scale block along both N and K; also the K step and the column tile
# w's block scales are stored SCALE_LANES times each and read 128 bytes at a time: a TMA copy into shared memory
# needs its destination 128-byte aligned, and the pipeline's buffers of 16-byte copies were not (the H200 reported a
# misaligned address).
SCALE_LANES = 32
CLUSTER = "cluster"  # the cluster axis: a CTA's rank in its cluster
# Cluster sizes the dense kernel takes: w's [128, 128] tile is multicast in `cluster` slices of its 8-row tiles, and
# pairs (DeepGEMM's choice) are the only size lowered and interpreted so far.
CLUSTER_SIZES = (1, 2)
# A proxy fence (`plgpu.commit_smem`) at the end of each consumer's K step, after its plain loads of the scales and
# before the pipeline hands the slot back to the producer's TMA (another proxy). PTX asks for one between accesses of
# two proxies to the same shared memory, and jax 0.11's interpreter enforces it: without it, its race detector
# reports each slot's refill as racing with the last step's reads (6 of the interpreter tests under jax 0.11.2;
# jax's own warp-specialized pipeline with plain loads in its steps is reported the same way,
# `bench/lab/pipeline_race_probe.py`). jax 0.10's detector has no proxies. With it on, jax 0.11.2's detector reports
# no race and the compiled tests pass; its cost (a fence and a warpgroup barrier per K step), one H100 run at 7dba43c
# (`h200_runs.sh fp8_fence`): 1,015 against 1,028 TFLOP/s at M = 4096, K = 7168, N = 18432, 414 against 417 at
# M = 128, the grouped shapes unchanged. Off: the loads' values are used before the step returns and the slot is
# handed back by a release arrival, and no run has shown a wrong value; on once an H200 run shows it costs nothing.
FENCE_STEP_READS = False


def row_multiple(tile_m: int = 64, cluster: int = 1) -> int:
    """What the dense kernel's M must be a multiple of: a [2 * tile_m, 128] output tile per CTA, and the `cluster`
    CTAs of a cluster on consecutive row tiles."""
    return cluster * 2 * tile_m


def fp8_block_matmul_mosaic(x8, x_scale, w8, w_scale, *, out_dtype=jnp.bfloat16, tile_m: int = 64,
                            steps_in_flight: int = 4, group_items: int = 16, cluster: int = 1,
                            num_programs: int | None = None, interpret=False):
    """See the module docstring. Output tiles are [2 * tile_m, 128], each consumer warpgroup computing
    [tile_m, 128] of it; `steps_in_flight` K steps are loaded ahead; `group_items` row tiles are swept together
    (each column tile of w is read once per group; see `_work_tile`). `cluster=2` runs clusters of two CTAs on pairs
    of row tiles, w's tiles multicast to both (see the module docstring). `num_programs` CTAs (default: one per SM)
    run the persistent loop, `cluster` at a time. `interpret`: True or Mosaic GPU's `InterpretGPUParams`."""
    M, N = x8.shape[0], w8.shape[0]
    cta_m, rows = 2 * tile_m, row_multiple(tile_m, cluster)
    if M % rows:
        raise ValueError(f"M={M} must be a multiple of {rows} (cluster={cluster} CTAs of {cta_m}-row tiles)")
    _check_scales(x8, x_scale, w8[None], w_scale[None])
    tiles = jnp.arange(M // cta_m, dtype=jnp.int32)
    out = _scaled_gemm(x8, x_scale, w8[None], w_scale[None], jnp.zeros_like(tiles), tiles, out_dtype=out_dtype,
                       tile_m=tile_m, steps_in_flight=steps_in_flight, group_items=group_items, cluster=cluster,
                       num_programs=num_programs, interpret=interpret)
    return out.reshape(M, N)  # item i is row tile i


def fp8_block_grouped_matmul_mosaic(x8, x_scale, w8, w_scale, group_sizes, *, out_dtype=jnp.bfloat16,
                                    tile_m: int = 64, steps_in_flight: int = 4, group_items: int = 16,
                                    cluster: int = 1, num_programs: int | None = None, interpret=False):
    """Rows x8[M, K] sorted by expert (`grouped_matmul`'s layout), row r times w8[g(r)]ᵀ (w8[E, N, K]) with block
    scales -> [M, N]; rows past sum(group_sizes) are zeros.

    TMA stores write whole tiles, so a row tile shared by two experts cannot be stored in place: each work item of
    `grouped_matmul.make_schedule` (expert, row tile) writes its own [2 * tile_m, N] block of a buffer, and each row
    is then gathered from the item that owns it (one more read and write of the output).

    `cluster` must be 1: a cluster's CTAs share w's tile, so the items they run together would have to be of one
    expert, and `make_schedule` does not pair them so (an expert's items may be odd in number)."""
    if cluster != 1:
        raise ValueError(f"the grouped Mosaic kernel runs without clusters (cluster=1), got cluster={cluster}: "
                         "paired items would have to share an expert")
    from .grouped_matmul import make_schedule
    from .packing import count_at_or_below

    M, E = x8.shape[0], w8.shape[0]
    cta_m = 2 * tile_m
    _check_scales(x8, x_scale, w8, w_scale)
    expert, tile, start, end = make_schedule(group_sizes, M, cta_m)
    pad = -M % cta_m
    blocks = _scaled_gemm(jnp.pad(x8, ((0, pad), (0, 0))), jnp.pad(x_scale, ((0, pad), (0, 0))), w8, w_scale,
                          expert, tile, out_dtype=out_dtype, tile_m=tile_m, steps_in_flight=steps_in_flight,
                          group_items=group_items, cluster=1, num_programs=num_programs, interpret=interpret)
    # The item of each row: items cover the rows in order, so it is the count of used items ending at or before it.
    used = expert >= 0
    ends = jnp.where(used, end, M + 1)
    rows = jnp.arange(M, dtype=jnp.int32)
    item = jnp.minimum(count_at_or_below(ends, rows), expert.shape[0] - 1)
    out = blocks[item, rows - tile[item] * cta_m]
    return jnp.where(_is_routed(expert[item], E)[:, None], out, jnp.zeros((), out_dtype))


def _check_scales(x8, x_scale, w8, w_scale):
    (M, K), (E, N, _) = x8.shape, w8.shape
    if N % BLOCK or K % BLOCK:
        raise ValueError(f"N={N} and K={K} must be multiples of {BLOCK}")
    if x_scale.shape != (M, K // BLOCK) or w_scale.shape != (E, N // BLOCK, K // BLOCK):
        raise ValueError(f"scales {x_scale.shape}, {w_scale.shape} do not fit x {x8.shape}, w {w8.shape}")


def _is_routed(expert, E: int):
    """Schedule items that compute: an expert's, not the tail past the routed rows (E) nor padding (-1)."""
    return (expert >= 0) & (expert < E)


def _work_tile(work, items, n_iters: int, group_items: int):
    """(item, column tile) of a persistent loop's work index over `items` items (a traced count: the routed ones;
    with clusters, the items here are work units, see `_scaled_gemm`).
    Items are swept in groups of `group_items`, and within a group the column tile is the slow index: the SMs at
    work together read a few column tiles of w (streamed from HBM once per group) against the group's rows (which
    stay in L2). Row-major order instead would read all of w (132 MB at DeepSeek's 18432 x 7168) from HBM once per
    row tile."""
    group = work // (group_items * n_iters)
    first = group * group_items
    size = jnp.minimum(group_items, items - first)  # the last group may be short
    within = work - first * n_iters
    return first + within % size, within // size


def _cta_item(unit, cluster: int):
    """The item this CTA computes of a work unit: without clusters the unit itself; with clusters, the units are
    runs of `cluster` consecutive items (row tiles, computed against one column tile of w), one per CTA."""
    if cluster == 1:
        return unit
    return unit * cluster + lax.axis_index(CLUSTER)


def _scaled_gemm(x8, x_scale, w8, w_scale, item_expert, item_tile, *, out_dtype, tile_m, steps_in_flight,
                 group_items, cluster, num_programs, interpret):
    """blocks[i] = x8[row tile item_tile[i]] @ w8[item_expert[i]]ᵀ with the block scales, float32 promotion per K
    step -> [items, 2 * tile_m, N]; items that are not routed (`_is_routed`) are skipped (their block is left as
    is). Those come last in `grouped_matmul.make_schedule` (the tail past the routed rows, then padding), so the
    persistent loop runs over the routed prefix only, its length read in the kernel: a decode step routes a few rows
    to a few experts of a schedule sized for E + M/128 items, and visiting every item cost each SM dozens of idle
    iterations per call.

    The loop's work units are runs of `cluster` consecutive items (`_cta_item`), each CTA of a cluster on one of
    them, and `group_items` counts items: a group of `group_items // cluster` units keeps as many rows in L2. A unit
    is routed when its first item is (with clusters every item is: only the dense kernel takes them).

    Each consumer runs a K step's wgmma and its promotion (64 rows x 128 columns of multiply-adds) back to back. Two
    ways to overlap them measured slower on the H200 (2026-12-01) and went: handing each step's shared memory back
    before the promotion (no gain, twice), and promoting step k - 1's product, held in registers, while step k's
    wgmma runs (1.258 ms against 1.071 at M = 4096, K = 7168, N = 18432)."""
    if cluster not in CLUSTER_SIZES:
        raise ValueError(f"cluster={cluster}: the kernel takes clusters of {CLUSTER_SIZES} CTAs")
    items = item_expert.shape[0]
    if items % cluster:
        raise ValueError(f"{items} items do not split into clusters of {cluster}")
    plgpu = mosaic_gpu()
    ops = kernel_ops(interpret)
    K, (E, N, _) = x8.shape[1], w8.shape
    cta_m = 2 * tile_m  # one [tile_m, 128] half per consumer warpgroup
    n_iters, k_iters = N // BLOCK, K // BLOCK
    group_units = max(1, min(group_items, items) // cluster)
    # Scales in the layout the K loop reads them, one row per K step: x's per row, w's per column block (each
    # repeated SCALE_LANES times, see there).
    xs_t = x_scale.astype(jnp.float32).T
    ws_t = jnp.repeat(jnp.swapaxes(w_scale.astype(jnp.float32), 1, 2), SCALE_LANES, axis=2)  # [E, K/128, N/4]
    swizzle = plgpu.find_swizzle(BLOCK * 8)  # a 128-byte e4m3 row
    operand = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    out_swizzle = plgpu.find_swizzle(BLOCK * out_bits)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))

    def pipeline(step, context):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=steps_in_flight, compute_context=context,
            in_specs=[
                plgpu.BlockSpec((cta_m, BLOCK), lambda k: (0, k), transforms=operand, memory_space=plgpu.SMEM),
                # With clusters, both CTAs load the same w tile (same column tile, same expert): multicast. Without,
                # the argument is left out: its default is () in jax 0.10 (which fails on None) and None in 0.11.
                plgpu.BlockSpec((BLOCK, BLOCK), lambda k: (0, k), transforms=operand, memory_space=plgpu.SMEM,
                                **({"collective_axes": (CLUSTER,)} if cluster > 1 else {})),
                plgpu.BlockSpec((1, cta_m), lambda k: (k, 0), memory_space=plgpu.SMEM),
                plgpu.BlockSpec((1, SCALE_LANES), lambda k: (k, 0), memory_space=plgpu.SMEM),
            ])

    def kernel(routed_gmem, expert_gmem, tile_gmem, x_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem):
        def no_op(*args, **kwargs):
            return None

        allocations = pipeline(no_op, no_op).get_allocations(
            x_gmem, w_gmem.at[0, pl.ds(0, BLOCK)], xs_gmem, ws_gmem.at[0, :, pl.ds(0, SCALE_LANES)])

        @functools.partial(pl.run_scoped, allocations=allocations,
                           out_smem=plgpu.SMEM((2, tile_m, BLOCK), out_dtype, transforms=out_transforms),
                           collective_axes="wg")
        def _scope(allocations, out_smem):
            wg = lax.axis_index("wg")
            routed = routed_gmem[0]  # work units

            # Both CTAs of a cluster have the same "sm" index (it counts clusters), hence the same work units and
            # column tiles in the same order, as the multicast needs.
            @plgpu.nd_loop((routed * n_iters,), collective_axes="sm")
            def _work(loop):
                (work,) = loop.index
                unit, n_idx = _work_tile(work, routed, n_iters, group_units)
                item = _cta_item(unit, cluster)
                expert, m_idx = expert_gmem[item], tile_gmem[item]
                rows = pl.ds(wg * tile_m, tile_m)
                columns = pl.ds(n_idx * BLOCK, BLOCK)

                def step(indices, x_smem, w_smem, xs_smem, ws_smem, total):
                    part = ops.matmul_transposed(x_smem.at[rows], w_smem)
                    # The column tile is one scale block of w: its scale is a scalar, folded into the row scales, so
                    # the promotion is one multiply-add per element.
                    row_scale = ops.load(xs_smem.at[0, rows], plgpu.Layout.WGMMA.reduce(1))
                    scales = row_scale * ws_smem[0, 0]
                    if FENCE_STEP_READS:
                        plgpu.commit_smem()
                    return total + part * lax.broadcast_in_dim(scales, part.shape, [0])

                def context(run):
                    total = run(ops.with_layout(jnp.zeros((tile_m, BLOCK), jnp.float32), plgpu.Layout.WGMMA))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read out_smem
                    out_smem[wg] = total.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[item, rows, columns])

                pipeline(step, context)(
                    x_gmem.at[pl.ds(m_idx * cta_m, cta_m), :], w_gmem.at[expert, columns, :],
                    xs_gmem.at[:, pl.ds(m_idx * cta_m, cta_m)],
                    ws_gmem.at[expert, :, pl.ds(n_idx * SCALE_LANES, SCALE_LANES)], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    # The grid counts clusters (a cluster of 1 lowers as no cluster at all).
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((items, cta_m, N), out_dtype),
        grid=(max(1, (num_programs or num_sms()) // cluster),), grid_names=("sm",), cluster=(cluster,),
        cluster_names=(CLUSTER,), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **interpret_option(interpret))
    routed_units = jnp.sum(_is_routed(item_expert[::cluster], E), dtype=jnp.int32)[None]
    return call(routed_units, item_expert.astype(jnp.int32), item_tile.astype(jnp.int32), x8, xs_t, w8, ws_t)
