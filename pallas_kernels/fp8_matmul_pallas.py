"""Pallas (Triton) kernels of the FP8 GEMMs; semantics, quantizers and dispatch in `fp8_matmul`.

The kernels take operands already in e4m3: x8[M, K] with one float32 scale per row and K block (`x_scale[M, ⌈K/bk⌉]`,
handed to the kernel transposed so that one K step reads BM consecutive scales), and w8[E, N, K] in the checkpoint's
layout with `w_scale[E, ⌈N/bn⌉, ⌈K/bk⌉]`, `block` = (bn, bk). The per-tensor format runs on the same kernels with its
scales broadcast to that shape (`fp8_matmul` does it).

Each program owns a [BM, BN] output tile and walks K in steps of bk, the scale block: per step it loads x8[BM, bk] and
w8[BN, bk], takes their e4m3 product with float32 accumulation (a dot contracting dim 1 of both: FP8 tensor cores
want both operands K-major, which the [N, K] layout already is, so nothing is transposed in memory) and adds it into
the float32 accumulator times the rows' x scales and the columns' w scales. The scales differ per K block, so they
cannot wait until after the loop; and Hopper's FP8 MMA accumulates with fewer bits than float32, which this per-block
"promotion" (DeepSeek-V3's recipe) confines to 128-term chains.

A column tile that lies inside one scale block (BN divides bn) has one weight scale per step: it is folded into the
BM row scales, so the accumulator update is one multiply-add per element. A wider tile (BN a multiple of bn) gathers
each column's scale, one more multiply per element.

Edges: rows past M and columns past N are loaded under masks and never stored (a dot row or column depends on its
own operand row only, so what the masked lanes hold cannot leak). A partial last K block (K not a multiple of bk) is
loaded with zeros past K in both operands, since those lanes do enter the sum.

Large 1-byte operands: Pallas' Triton lowering addresses an array of at most 2^32 bytes with 32-bit element offsets,
which overflow past 2^31 elements, as a single device's MoE down projection of DeepSeek-V3 (256 x 7168 x 2048 =
3.8 G e4m3 elements) does. Such operands go in as byte pairs (uint16 [..., K/2], a free bitcast; half the element
offsets): the kernel splits each loaded pair tile into its low and high bytes and takes two e4m3 dots of half the
K step, the even and the odd channels, whose sum is the block's product (x and w are paired alike).

Dense: grid (N tiles, M tiles, K splits), the M tile fastest, so the programs running at once share few weight tiles
and read the activations (the smaller operand) through L2; with `split_k` > 1 each split of the K blocks writes a
float32 partial sum and XLA adds them (for a few rows against a weight of few column tiles). Grouped (MoE): the work
items of `grouped_matmul.make_schedule` (expert, row tile, row range) on a grid (N tiles, items), each program
storing only its item's rows; tail items store zeros, padding items nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import (MAX_BYTE_ELEMENTS, as_byte_pairs, first_problem, fit_stages, needs_byte_pairs,
                        next_pow2, num_sms, pow2_tile_problem, split_byte_pairs)
from .grouped_matmul import default_block_m, make_schedule


def default_tiles(rows: int, experts: int = 1) -> dict:
    """Tile options for `rows` rows (over `experts` groups).

    Dense: the best of the H200 sweep (`bench/fp8_kernels.py --sweep`, 2026-12-01, K = 7168, N = 18432): 128 x 64 on
    4 warps from 1024 rows (M = 4096: 3.10 ms against 3.29 for 128 x 128 on 8), 64 x 64 below (M = 128: 0.129 ms
    against 0.210), 16 x 32 for a few rows (M = 16: 0.044 ms against 0.049).

    Grouped (not swept yet): 128 x 128 with 8 warps (two warpgroups, one 64-row wgmma each) and 4 stages of
    (128 + 128) x 128 bytes, 128 KiB of the 227 KiB shared memory, for prefill-sized groups; decode batches read the
    weights once whatever the row tile, so the row tile shrinks to the rows there are (Triton's dot takes 16 at
    least) and the column tile to 64: more programs than SMs even at N = 7168, and 4 warps suffice."""
    block_m = default_block_m(rows, experts)
    if experts == 1:
        if block_m >= 64:
            return dict(block_m=128 if rows >= 1024 else 64, block_n=64, num_warps=4, num_stages=4)
        return dict(block_m=block_m, block_n=32, num_warps=4, num_stages=4)
    if block_m >= 64:
        return dict(block_m=block_m, block_n=128, num_warps=8 if block_m == 128 else 4, num_stages=4)
    return dict(block_m=block_m, block_n=64, num_warps=4, num_stages=4)


# At most this many K blocks per split when the output tiles leave SMs idle: o_proj (K = 16384, 128 blocks) and the
# dense MLP's down projection (144 blocks) at one row ran fastest in 4 splits, 1.5x the one split (H200, 2026-12-01).
_MAX_K_BLOCKS_PER_SPLIT = 36


def _split_for(programs: int, k_steps: int, sms: int) -> int:
    """The dense kernel's default `split_k` for a grid of `programs` output tiles over `k_steps` K blocks: 1 when the
    tiles give two programs per SM; else enough splits for that, or for at most _MAX_K_BLOCKS_PER_SPLIT blocks per
    split if more, as a power of two (uneven splits measured slower), each split walking at least 4 K blocks (what
    the 4-stage load pipeline overlaps). Measured on the H200 for DeepSeek-V3.2's decode linears at 1 and 32 rows
    (`bench/fp8_kernels.py --only decode`): kv_a (N = 576) 19 -> 12 µs, o_proj 52 -> 34, q_a 19 -> 12; q_b (768
    column tiles) stays at one split."""
    if programs >= 2 * sms:
        return 1
    want = next_pow2(max(-(-2 * sms // programs), -(-k_steps // _MAX_K_BLOCKS_PER_SPLIT)))
    cap = max(1, k_steps // 4)
    return min(want, 1 << (cap.bit_length() - 1))  # both at least 1


def suggested_split_k(rows: int, N: int, K: int, block: tuple[int, int], sms: int | None = None) -> int:
    """The dense kernel's default `split_k` with `default_tiles(rows)` (`_split_for`; `sms`: `num_sms()`)."""
    tiles = default_tiles(rows)
    return _split_for(-(-N // tiles["block_n"]) * -(-rows // tiles["block_m"]), -(-K // block[1]), sms or num_sms())


def pallas_problem(block: tuple[int, int], block_m: int | None = None, block_n: int | None = None) -> str | None:
    """Why the compiled kernel cannot take this scale block or these tiles (None when it can): the K step is the
    scale block's width and, like the tiles, a Triton dot dimension."""
    return first_problem(pow2_tile_problem("the K step (block[1])", block[1]),
                         block_m and pow2_tile_problem("block_m", block_m),
                         block_n and pow2_tile_problem("block_n", block_n))


def _scaled_tile(x_ref, xs_ref, w_ref, ws_ref, e, r0, n0, *, M, N, K, block, block_m, block_n, byte_pairs,
                 k_blocks=None):
    """float32 [BM, BN]: Σ over K blocks of (x8 · w8[e]ᵀ)[rows r0.., cols n0..] · x scale (per row) · w scale (per
    column), the K blocks in order: all of them, or those in `k_blocks` = (first, stop). With `byte_pairs` x_ref and
    w_ref hold uint16 channel pairs (`as_byte_pairs`)."""
    bn, bk = block
    rows, cols = r0 + jnp.arange(block_m), n0 + jnp.arange(block_n)
    row_ok, col_ok = rows < M, cols < N
    partial_k = K % bk != 0
    one_scale_column = bn % block_n == 0
    nt = (((1,), (1,)), ((), ()))  # contract the K dim of both: x @ w.T
    width = 2 if byte_pairs else 1  # channels per loaded element

    def step(kb, acc):
        k0 = pl.multiple_of(kb * bk // width, bk // width)
        x_mask, w_mask, fill = row_ok[:, None], col_ok[:, None], {}
        if partial_k:
            in_k = (k0 + jnp.arange(bk // width) < K // width)[None, :]
            x_mask, w_mask, fill = x_mask & in_k, w_mask & in_k, dict(other=jnp.zeros((), x_ref.dtype))
        xt = plgpu.load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, bk // width)], mask=x_mask, **fill)
        wt = plgpu.load(w_ref.at[e, pl.ds(n0, block_n), pl.ds(k0, bk // width)], mask=w_mask, **fill)
        if byte_pairs:
            (x_even, x_odd), (w_even, w_odd) = split_byte_pairs(xt), split_byte_pairs(wt)
            part = (lax.dot_general(x_even, w_even, nt, preferred_element_type=jnp.float32)
                    + lax.dot_general(x_odd, w_odd, nt, preferred_element_type=jnp.float32))
        else:
            part = lax.dot_general(xt, wt, nt, preferred_element_type=jnp.float32)
        x_scale = plgpu.load(xs_ref.at[kb, pl.ds(r0, block_m)], mask=row_ok, other=0.0)
        if one_scale_column:
            row_scale = x_scale * ws_ref[e, n0 // bn, kb]
            return acc + part * row_scale[:, None]
        w_scale = plgpu.load(ws_ref.at[e, cols // bn, kb], mask=col_ok, other=0.0)
        return acc + part * x_scale[:, None] * w_scale[None, :]

    first, stop = k_blocks or (0, pl.cdiv(K, bk))
    return lax.fori_loop(first, stop, step, jnp.zeros((block_m, block_n), jnp.float32))


def _dense_kernel(x_ref, xs_ref, w_ref, ws_ref, o_ref, *, M, N, K, block, block_m, block_n, byte_pairs,
                  k_blocks_per_split):
    """One [BM, BN] tile over one split of the K blocks (program axis 2). With one split (`k_blocks_per_split`
    None: a 2-D grid and static loop bounds, the kernel as it was before splits), the output tile itself; with
    several, o_ref is float32 [splits, M, N] and the split writes its partial sum (the caller adds them)."""
    n0, r0 = pl.program_id(0) * block_n, pl.program_id(1) * block_m
    k_blocks = None
    if k_blocks_per_split is not None:  # a third grid axis, the split
        split = pl.program_id(2)
        first = split * k_blocks_per_split
        k_blocks = (first, jnp.minimum(first + k_blocks_per_split, pl.cdiv(K, block[1])))
    # The one expert's index as an array: interpret mode's load rule takes no Python int among array indices.
    acc = _scaled_tile(x_ref, xs_ref, w_ref, ws_ref, jnp.int32(0), r0, n0, M=M, N=N, K=K, block=block, block_m=block_m,
                       block_n=block_n, byte_pairs=byte_pairs, k_blocks=k_blocks)
    in_tile = ((r0 + jnp.arange(block_m)) < M)[:, None] & ((n0 + jnp.arange(block_n)) < N)[None, :]
    out = o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)] if k_blocks is None else \
        o_ref.at[split, pl.ds(r0, block_m), pl.ds(n0, block_n)]
    plgpu.store(out, acc.astype(o_ref.dtype), mask=in_tile)


def _grouped_kernel(expert_ref, tile_ref, start_ref, end_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, M, N, K, E,
                    block, block_m, block_n, byte_pairs):
    n0, item = pl.program_id(0) * block_n, pl.program_id(1)
    e, r0 = expert_ref[item], tile_ref[item] * block_m
    rows = r0 + jnp.arange(block_m)
    in_item = ((rows >= start_ref[item]) & (rows < end_ref[item]))[:, None] & ((n0 + jnp.arange(block_n)) < N)[None, :]
    out = o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)]

    @pl.when((e >= 0) & (e < E))
    def _product():
        acc = _scaled_tile(x_ref, xs_ref, w_ref, ws_ref, e, r0, n0, M=M, N=N, K=K, block=block, block_m=block_m,
                           block_n=block_n, byte_pairs=byte_pairs)
        plgpu.store(out, acc.astype(o_ref.dtype), mask=in_item)

    @pl.when(e == E)
    def _tail():
        plgpu.store(out, jnp.zeros((block_m, block_n), o_ref.dtype), mask=in_item)


def _checked_options(block, rows, experts, options, interpret, *, dense=False):
    """The tile options (defaults from `default_tiles`, overridden by `options`), checked for Triton. `split_k`
    (the dense kernel's only) is None unless given: `_split_for` the grid."""
    known = {"block_m", "block_n", "num_warps", "num_stages", "byte_pairs"} | ({"split_k"} if dense else set())
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown FP8 kernel options {sorted(unknown)}")
    tiles = {**default_tiles(rows, experts), "byte_pairs": None, **({"split_k": None} if dense else {}),
             **{k: v for k, v in options.items() if v is not None}}
    if options.get("num_stages") is None:  # e4m3 tiles of both operands per K step, sized for the H200
        tiles["num_stages"] = fit_stages(tiles["num_stages"], (tiles["block_m"] + tiles["block_n"]) * block[1])
    if (tiles.get("split_k") or 1) < 1:
        raise ValueError(f"split_k must be >= 1, got {tiles['split_k']}")
    if not interpret and (problem := pallas_problem(block, tiles["block_m"], tiles["block_n"])):
        raise ValueError(problem)
    return tiles


def _paired_operands(x8, w8, byte_pairs):
    """(x, w, byte_pairs) as the kernel takes them: byte pairs when asked (True) or needed (None)."""
    if byte_pairs is None:
        byte_pairs = needs_byte_pairs(x8, w8)
    if not byte_pairs:
        return x8, w8, False
    if x8.shape[-1] % 2:
        raise ValueError(f"FP8 operands past {MAX_BYTE_ELEMENTS} elements need an even K, got K={x8.shape[-1]}")
    return as_byte_pairs(x8), as_byte_pairs(w8), True


def _check_operands(x8, x_scale, w8, w_scale, block):
    M, K = x8.shape
    grid = (-(-w8.shape[1] // block[0]), -(-K // block[1]))
    if x8.dtype != jnp.float8_e4m3fn or w8.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"operands must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    if w8.shape[2] != K or x_scale.shape != (M, grid[1]) or w_scale.shape != (w8.shape[0], *grid):
        raise ValueError(f"x8 {x8.shape}, x_scale {x_scale.shape}, w8 {w8.shape}, w_scale {w_scale.shape} do not fit "
                         f"block {block}")


def fp8_block_matmul(x8, x_scale, w8, w_scale, *, block: tuple[int, int], out_dtype, interpret: bool = False,
                     **options):
    """x8[M, K] @ w8[N, K]ᵀ with block scales (x_scale[M, ⌈K/bk⌉], w_scale[⌈N/bn⌉, ⌈K/bk⌉]) -> out_dtype[M, N].
    `options`: block_m, block_n, num_warps, num_stages (None or absent: `default_tiles`), byte_pairs (None or
    absent: when an operand needs them), split_k (None or absent: `_split_for` the grid): the K blocks split over
    that many programs per output tile (at most one split per K block), whose float32 partial sums are added
    afterwards. For a few rows against a narrow or long weight (DeepSeek's kv_a: N = 576, K = 7168, 18 column tiles
    of 32) one split leaves most SMs idle; more splits give them work for one extra float32 [splits, M, N] round
    trip."""
    _check_operands(x8, x_scale, w8[None], w_scale[None], block)
    (M, K), N = x8.shape, w8.shape[0]
    if M == 0:
        return jnp.zeros((0, N), out_dtype)
    tiles = _checked_options(block, M, 1, options, interpret, dense=True)
    block_m, block_n = tiles["block_m"], tiles["block_n"]
    k_steps = pl.cdiv(K, block[1])
    split_k = tiles["split_k"] or _split_for(pl.cdiv(N, block_n) * pl.cdiv(M, block_m), k_steps, num_sms())
    per_split = pl.cdiv(k_steps, min(split_k, k_steps))
    splits = pl.cdiv(k_steps, per_split)  # none empty
    x_in, w_in, byte_pairs = _paired_operands(x8, w8[None], tiles["byte_pairs"])
    kernel = functools.partial(_dense_kernel, M=M, N=N, K=K, block=block, block_m=block_m, block_n=block_n,
                               byte_pairs=byte_pairs, k_blocks_per_split=per_split if splits > 1 else None)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, block_n), pl.cdiv(M, block_m), *([splits] if splits > 1 else [])),
        out_shape=jax.ShapeDtypeStruct((M, N) if splits == 1 else (splits, M, N),
                                       out_dtype if splits == 1 else jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]),
        interpret=interpret,
        name="fp8_block_matmul",
    )(x_in, x_scale.T, w_in, w_scale[None])
    return out if splits == 1 else out.sum(axis=0).astype(out_dtype)


def fp8_block_grouped_matmul(x8, x_scale, w8, w_scale, group_sizes, *, block: tuple[int, int], out_dtype,
                             interpret: bool = False, **options):
    """Rows x8[M, K] sorted by expert (see `grouped_matmul`), row r times its expert's w8[g(r)]ᵀ (w8[E, N, K]) with
    block scales (x_scale[M, ⌈K/bk⌉], w_scale[E, ⌈N/bn⌉, ⌈K/bk⌉]) -> out_dtype[M, N]; rows past sum(group_sizes) are
    zeros."""
    _check_operands(x8, x_scale, w8, w_scale, block)
    (M, K), (E, N, _) = x8.shape, w8.shape
    tiles = _checked_options(block, M, E, options, interpret)
    block_m, block_n = tiles["block_m"], tiles["block_n"]
    schedule = make_schedule(group_sizes, M, block_m)
    x_in, w_in, byte_pairs = _paired_operands(x8, w8, tiles["byte_pairs"])
    kernel = functools.partial(_grouped_kernel, M=M, N=N, K=K, E=E, block=block, block_m=block_m, block_n=block_n,
                               byte_pairs=byte_pairs)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(N, block_n), schedule[0].shape[0]),
        out_shape=jax.ShapeDtypeStruct((M, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"]),
        interpret=interpret,
        name="fp8_block_grouped_matmul",
    )(*schedule, x_in, x_scale.T, w_in, w_scale)

