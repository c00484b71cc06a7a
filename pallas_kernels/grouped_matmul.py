"""Grouped matmul for MoE experts: `out[r] = x[r] @ w[g(r)]` with the rows of x sorted by expert.

`grouped_matmul(x[M, K], w[E, K, N], group_sizes[E]) -> [M, N]`: rows `offsets[g] .. offsets[g] + group_sizes[g]`
use expert g (offsets = exclusive cumsum of group_sizes); `sum(group_sizes) <= M` and rows past the sum come out as
zeros. Empty groups are fine. Output dtype = x's; accumulation in float32.

XLA reference: `lax.ragged_dot` (it zero-fills rows past the group total too).

Pallas kernel (Triton lowering), megablox-style: the wrapper cuts the row range into segments (the E groups, then
one tail segment for rows past the total) and lists work items (segment, row tile of BM rows) for every row tile a
segment touches: at most `ceil(M / BM) + E` items, so the grid is static whatever the group sizes. Grid =
(N / BN, items): the N tile is the slow axis so consecutive programs walk the items of one weight column block
and reuse x tiles through L2. Each program loads its item (expert id, tile, row range) from the schedule, runs a
K loop `acc += x_tile @ w[e, k-slice, n-slice]` and stores only the rows of its segment (a row tile shared by two
experts is computed twice, once per expert, each store masked to its rows). Tail items store zeros; padding
items do nothing.

`extra=ExtraExperts(weights, split)` puts S more experts before w's E, each a [K, N] window of one matrix: a dense
MLP's projection cut along its intermediate dimension into experts of w's size (split "n": weights [K, S * N], expert
j its columns j * N ..; split "k": weights [S * K, N], its rows j * K ..); w's expert g is then group S + g, and
group_sizes has S + E entries. An MoE layer's shared expert rides in its routed experts' launch this way, every token
one more row of each of its S pieces, without a copy of either weight (SGLang's shared-experts fusion appends the
weights to the stack instead). First, so that a few tokens' rows of the pieces share the first row tile and each
piece's weights are read once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import dot_precision, fit_stages, largest_pow2_divisor, next_pow2, pow2_tile_problem, resolve_impl
from .packing import count_at_or_below, prefix_sum


def relu2(x):
    """Squared ReLU, the activation of Nemotron-H MLPs and experts."""
    return jnp.square(jnp.maximum(x, 0))


# Activations the kernel applies to its output tile (`epilogue=`), saving the activation's own kernel. Applied to the
# output rounded to its dtype, in float32, then rounded again: what the activation as a separate op computes (a
# 16-bit square is exact in float32 before its one rounding).
EPILOGUES = {"relu2": relu2}


class ExtraExperts(NamedTuple):
    """Experts put before a stack's E (see the module docstring): S windows of `weights`, cut along `split`."""

    weights: jax.Array
    split: str  # "n": weights [K, S * N]; "k": weights [S * K, N]

    def count(self, K: int, N: int) -> int:
        rows, cols = self.weights.shape
        if self.split == "n" and rows == K and cols % N == 0:
            return cols // N
        if self.split == "k" and cols == N and rows % K == 0:
            return rows // K
        raise ValueError(f"extra experts of shape {self.weights.shape} split {self.split!r} do not cut into "
                         f"[{K}, {N}] experts")

    def as_stack(self, K: int, N: int) -> jax.Array:
        """[S, K, N]: the windows as a stack (a copy; the reference's, not the kernel's)."""
        S = self.count(K, N)
        if self.split == "n":
            return self.weights.reshape(K, S, N).transpose(1, 0, 2)
        return self.weights.reshape(S, K, N)


def grouped_matmul_reference(x, w, group_sizes, *, epilogue: str | None = None, extra: ExtraExperts | None = None):
    if extra is not None:
        w = jnp.concatenate([extra.as_stack(*w.shape[1:]).astype(w.dtype), w])
    out = lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
                         precision=dot_precision(x.dtype)).astype(x.dtype)
    return out if epilogue is None else EPILOGUES[epilogue](out)


def make_schedule(group_sizes, M: int, block_m: int, *, trim_items: bool = False):
    """Work items for the kernel: int32 arrays (expert or E for the tail or -1 for padding, tile, row_start, row_end).

    Segment s covers rows [start_s, end_s); item i handles the rows of segment s that fall in its row tile.

    There are row tiles + E items, or with `trim_items` row tiles + min(E, M), which is also enough: the non-empty
    segments (at most min(E + 1, M) of them, the tail included) partition the M rows, each adds one item per row tile
    it touches, and consecutive segments share at most their boundary tile, so they need at most row tiles - 1 + the
    number of non-empty segments. At decode (M = B x top_k rows over 128-256 experts) that drops most of the grid's
    programs, which would find no expert and return.
    """
    E = group_sizes.shape[0]
    # Segment ends: the groups' running totals, then M for the zero tail (sum(group_sizes) <= M).
    seg_end = jnp.concatenate([prefix_sum(group_sizes.astype(jnp.int32)), jnp.full((1,), M, jnp.int32)])
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end[:-1]])
    first_tile = seg_start // block_m
    last_tile = (seg_end - 1) // block_m
    n_tiles = jnp.where(seg_end > seg_start, last_tile - first_tile + 1, 0)
    num_items = pl.cdiv(M, block_m) + (min(E, max(M, 1)) if trim_items else E)  # each boundary adds at most one tile
    item_end = prefix_sum(n_tiles)
    item_first = item_end - n_tiles  # first item index of each segment
    i = jnp.arange(num_items, dtype=jnp.int32)
    # The segment of item i: segments own consecutive items, so it is the count of segments ending at or before i
    # (items past the last used one land on E + 1 and are masked as unused below).
    item_seg = jnp.minimum(count_at_or_below(item_end, i), E)
    used = i < item_end[-1]
    tile = first_tile[item_seg] + (i - item_first[item_seg])
    row_start = jnp.maximum(seg_start[item_seg], tile * block_m)
    row_end = jnp.minimum(seg_end[item_seg], (tile + 1) * block_m)
    expert = jnp.where(used, item_seg, -1)
    return (expert.astype(jnp.int32), jnp.where(used, tile, 0).astype(jnp.int32),
            jnp.where(used, row_start, 0).astype(jnp.int32), jnp.where(used, row_end, 0).astype(jnp.int32))


def _gmm_kernel(expert_ref, tile_ref, start_ref, end_ref, x_ref, w_ref, *refs, M, K, N, E, S, split, block_m,
                block_n, block_k, epilogue):
    extra_ref, o_ref = refs if S else (None, *refs)
    n0 = pl.program_id(0) * block_n
    item = pl.program_id(1)
    e = expert_ref[item]
    r0 = tile_ref[item] * block_m
    rows = r0 + jnp.arange(block_m)
    in_seg = (rows >= start_ref[item]) & (rows < end_ref[item])
    cols = n0 + jnp.arange(block_n)

    def matmul(weight_tile):
        """The item's output tile, weight_tile(k0) giving the [block_k, block_n] slab of its expert at k0."""
        def body(kk, acc):
            k0 = pl.multiple_of(kk * block_k, block_k)
            # Rows past M are masked (M need not be a multiple of BM); rows of other segments are computed
            # but never stored.
            xt = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], mask=(rows < M)[:, None], other=0)
            wt = weight_tile(k0)
            return acc + jnp.dot(xt, wt, preferred_element_type=jnp.float32, precision=dot_precision(xt.dtype))

        acc = lax.fori_loop(0, K // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        out = acc.astype(o_ref.dtype)
        if epilogue is not None:
            out = EPILOGUES[epilogue](out.astype(jnp.float32)).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], out, mask=in_seg[:, None] & (cols < N)[None, :])

    if S:
        @pl.when((e >= 0) & (e < S))
        def _extra():
            # Expert e's window: columns (split "n") or rows (split "k") from e * N or e * K.
            def weight_tile(k0):
                if split == "n":
                    window = extra_ref.at[pl.ds(k0, block_k), pl.ds(e * N + n0, block_n)]
                else:
                    window = extra_ref.at[pl.ds(e * K + k0, block_k), pl.ds(n0, block_n)]
                return plgpu.load(window, mask=(cols < N)[None, :], other=0)

            matmul(weight_tile)

    @pl.when((e >= S) & (e < S + E))
    def _routed():
        stacked = e - S if S else e
        matmul(lambda k0: plgpu.load(w_ref.at[stacked, pl.ds(k0, block_k), pl.ds(n0, block_n)],
                                     mask=(cols < N)[None, :], other=0))

    @pl.when(e == S + E)
    def _tail():
        plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)],
                    jnp.zeros((block_m, block_n), o_ref.dtype), mask=in_seg[:, None] & (cols < N)[None, :])


def default_block_m(rows: int, experts: int) -> int:
    """Row tile for `rows` rows over `experts` groups: the mean group size rounded up to a power of two, between 16
    (Triton's smallest dot tile) and 128. Decode batches put a handful of rows on each expert: a 128-row tile would
    compute (and hold registers for) mostly masked rows, while the weights, which dominate, are read once either way.
    """
    mean = -(-rows // max(experts, 1))
    return min(128, max(16, next_pow2(mean)))


def default_columns(rows: int, experts: int) -> tuple[int, int]:
    """(block_n, num_warps). 256 columns on 8 warps, from bench/dsa_kernels.py on the H200 (2026-11-30):
    128x256x64, 8 warps, 3 stages beat 128x128x64 (4 warps, 4 stages) on both MoE shapes at 2k and 16k tokens, e.g.
    485 vs 439 TFLOP/s at 16k x 256x8. With fewer rows than experts (decode at a few sequences: each touched
    expert has about one row, and its weights are the whole cost) 128 columns on 4 warps: twice the programs, each
    reading half the slab. `--only gmm_decode`, 2026-12-01, one token: Nemotron-30B down projection 0.074 -> 0.057
    ms, DeepSeek up 0.108 -> 0.099, the others within 4%; from 32 sequences the two tilings were within 2%."""
    return (128, 4) if rows < experts else (256, 8)


def grouped_matmul_pallas(x, w, group_sizes, *, block_m: int | None = None, block_n: int | None = None,
                          block_k: int = 64, num_warps: int | None = None, num_stages: int | None = None,
                          epilogue: str | None = None, extra: ExtraExperts | None = None, trim_items: bool = False,
                          interpret: bool = False):
    """`trim_items`: see make_schedule (off: on the H200 it moved nothing at 32 and 256 rows and stayed within the
    spread at one row, docs/BENCHMARKS.md "Grouped-matmul decode tiles")."""
    M, K = x.shape
    E, K2, N = w.shape
    S = extra.count(K, N) if extra is not None else 0
    if group_sizes.shape[0] != S + E:
        raise ValueError(f"{group_sizes.shape[0]} group sizes for {S} extra experts and {E} stacked ones")
    block_m = block_m or default_block_m(M, S + E)
    default_n, default_warps = default_columns(M, S + E)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    if num_stages is None:  # 3, or fewer where the x and w tiles of 3 K steps do not fit (`fit_stages`)
        num_stages = fit_stages(3, (block_m + block_n) * block_k * x.dtype.itemsize)
    if K2 != K:
        raise ValueError(f"x has K={K}, w has K={K2}")
    if not interpret and (problem := pallas_problem(K, block_k)):
        raise ValueError(problem)
    block_k = largest_pow2_divisor(K, block_k)
    # N need not be a multiple of block_n (Nemotron's 1856 = 29 * 64): the last column tile is masked.
    schedule = make_schedule(group_sizes, M, block_m, trim_items=trim_items)
    num_items = schedule[0].shape[0]
    kernel = functools.partial(_gmm_kernel, M=M, K=K, N=N, E=E, S=S, split=extra.split if S else None,
                               block_m=block_m, block_n=block_n, block_k=block_k, epilogue=epilogue)
    weights = (w, extra.weights.astype(w.dtype)) if S else (w,)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, block_n), num_items),
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(*schedule, x, *weights)


def pallas_problem(K: int, block_k: int = 64) -> str | None:
    """Why the compiled kernel cannot take this contraction size (the K loop steps by a power-of-two tile)."""
    return pow2_tile_problem("the largest power-of-two tile dividing K", largest_pow2_divisor(K, block_k))


def grouped_matmul(x, w, group_sizes, *, epilogue: str | None = None, extra: ExtraExperts | None = None,
                   impl: str = "auto", interpret: bool = False, **kernel_options):
    """See the module docstring; `epilogue` names an activation of EPILOGUES applied to the output, `extra` puts
    experts cut from one matrix before w's."""
    if epilogue is not None and epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is none of {sorted(EPILOGUES)}")
    if resolve_impl(impl, interpret, pallas_problem(x.shape[1]), "grouped_matmul") == "xla":
        return grouped_matmul_reference(x, w, group_sizes, epilogue=epilogue, extra=extra)
    return grouped_matmul_pallas(x, w, group_sizes, epilogue=epilogue, extra=extra, interpret=interpret,
                                 **kernel_options)
