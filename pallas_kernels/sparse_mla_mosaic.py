"""Sparse MLA decode for Hopper through Pallas' Mosaic GPU backend: FlashMLA's split of the work over warpgroups,
with the selected latent rows gathered into shared memory by `cp.async` (issue 42). `sparse_mla_attention`'s `auto`
takes it on Hopper. On the H200 at top-2048 and 128 heads: 0.017 / 0.050 / 0.156 ms at B = 1 / 32 / 128, against the
Triton kernel's 0.036 / 0.179 / 0.308; 51% of the byte floor at B = 128 (docs/BENCHMARKS.md). Prefill chunks (2,048
queries) take as long on either kernel, 4.85 ms, on the owner schedule, which `auto` keeps for them: `decode_splits`
cuts their lists in 8 splits of 4 blocks.

`sparse_mla_decode_mosaic(q[T, H, 576], flat_cache[N, 576], indices[T, k], *, scale, listed) -> [T, H, 512]`: the
semantics of `sparse_mla_attention.sparse_mla_attention_reference` (bf16 q and cache, absorbed MLA, Dl = 512 value
columns and Dr = 64 rope columns, −1 = no key), for H a multiple of 64.

Why another kernel: the Triton one (`sparse_mla_attention_pallas`) decodes B=128 at top-2048 and 128 heads in
0.310 ms, 26% of the byte floor (0.080) where its FLOP floor is 0.090 (docs/BENCHMARKS.md). It runs 32 heads a
program on `mma.sync` tiles, which re-read the gathered rows from shared memory for every 32 heads; its [32, 512]
float32 accumulator already spills at 255 registers (84 bytes, `.venv-aot/bin/python tools/aot_h200.py
sparse_mla_triton`), and 64 heads a program spilled more in Triton. FlashMLA reaches about 410 TFLOP/s on the H800
with 64 heads a program, wgmma tiles, and a [64, 512] float32 accumulator split between two warpgroups, which is
what this kernel builds.

A program (CTA) takes 64 heads of one query and one split of its top-k list, in blocks of 64 keys, with three
warpgroups:
  * the producer (warpgroup 2) gathers each block's 64 latent rows into a shared-memory slot (two slots) laid out
    for wgmma: 8-row tiles of 64 columns with the 128-byte swizzle. Hopper's TMA copies boxes, not lists of rows
    (its row gather is Blackwell's), and Pallas rejects a one-row TMA into an 8-row tile, so the rows are copied
    16 bytes a thread with `cp.async` (emitted through `plgpu.inline_mgpu`, `_gather_block`), eight threads a row
    (each copy instruction of a warp reads 128 contiguous bytes of 4 rows). A −1 entry copies zeros (source size
    0). It also copies the block's 64 indices, which mark the keys that are none. A thread loads the indices of its
    rows a block ahead (`load_keys`), so that a gather's copies wait for no load.
  * warpgroup 0 owns the softmax: S = Q Kᵀ over all 576 columns ([64 heads, 64 keys], the query block read from
    shared memory, loaded once), the online softmax in base 2, then O[:, :256] += P V[:, :256] with P in bf16 from
    its registers. It also writes P to shared memory, where the slot's rope columns were (S was their only reader,
    and the slot is refilled only once both warpgroups are done with it), with each row's rescale factor.
  * warpgroup 1 takes P and the rescale from shared memory and adds P V[:, 256:] into O[:, 256:].
`OWNER_COLUMNS` sets warpgroup 0's share of the value columns (256); warpgroup 1 takes the rest, a wgmma per 256.
Warpgroup 0 issues 3.4 M of the 4.5 M multiply-adds a block. FlashMLA balances the two by alternating which one
computes S ("seesaw"), which needs each warpgroup's softmax to wait for the other's row maxima; this first form
keeps one owner of the softmax state and relies on warpgroup 1's products filling the tensor cores while warpgroup 0
runs its softmax. At B = 128 on the H200 that leaves the tensor pipe busy 53% of the time, with DRAM at 31% of its
peak and L2 at 53% (Nsight Compute, `bash bench/lab/h200_runs.sh mla_ncu_mosaic`). More overlap in warpgroup 0 (the
seesaw, the slot in parts, an early S: below) has not paid. The next block's S issued before this block's softmax
would need a third row slot (with two, that block's rows could only be gathered once the slot of the block before
was free, just before they are needed), and shared memory holds two: the query block 72 KiB and two row slots of 72
KiB (226 KiB with Pallas' own, of the H200's 227).

`SCHEDULE = "seesaw"` (and `"auto"`, the default, for programs of 32 blocks or more) builds the seesaw as FlashMLA's
sparse prefill kernel runs it (about 640 TFLOP/s on the H800, where this kernel does 470 on the H200 at B = 128;
`_seesaw_schedule`): the warpgroups own alternate blocks of a pair and half of O each, and each half of a slot is
gathered, published and freed on its own, so that the next pair's first halves are gathered while this pair is computed.
Warpgroup 1's P needs a buffer of its own (8 KiB), which fits once Pallas' 2 KiB of reduction scratch is off. As in
FlashMLA, warpgroup 0 issues the next pair's S behind its last P V of a pair, so that the tensor cores do not drain
between them (`SEESAW_EARLY_S`), and the producer never waits for its copies: each thread's copies arrive on their half
slot's barrier themselves once they have landed (`cp.async.mbarrier.arrive.noinc`, `_LandedByCopies`), so that each
gather goes out as soon as its half slot is free. Pallas cannot give its barriers such an arrival, so those barriers are
mbarriers of the kernel's own, in inline code; the interpreter runs Pallas barriers in their place.

Measured with the producer waiting for its copies before publishing (`cp.async.wait_group`, as until 51e2295), the
seesaw lost in every run (H100, B = 128, `bash bench/lab/h200_runs.sh mla_seesaw` at acb2037, 03bb1d8, b0762fa and
51e2295, one run each): whole 0.193 / 0.192 / 0.193 / 0.191 ms against the owner schedule's 0.174 / 0.171 / 0.172 /
0.168, though its compute alone was the faster (0.130 / 0.131 / 0.137 at 03bb1d8 / b0762fa / 51e2295, against the
owner's 0.145 / 0.146 at the first two), and with its copies never waited for (a wrong output: their traffic without
their latency) 0.163 / 0.155 at b0762fa / 51e2295. The producer's waits were serial: each half slot's publication waited
for its copies to land before the next gather could wait for its slot, three or four latencies a pair; publishing the
halves freed at a pair's end one by one too gave 0.189 (0.201 in the other order). The arriving copies take those waits
out of the producer. With them (7dba43c, H100, `mla_variants` then `mla_split`, two runs) the seesaw passes its compiled
tests and draws level at B = 128: 0.162 / 0.166 ms against the owner schedule's 0.171 / 0.167 (its compute alone 0.128),
and trails at B = 32 (0.057 / 0.057 against 0.055 / 0.055); warpgroup 0 on 192 columns gave 0.168 / 0.169 at B = 128. On
the H200 (eae4f4d, `mla_split` at B = 128 / 96 / 64 / 32, one run) the seesaw leads where a program walks 32 blocks:
0.159 ms against 0.166 at B = 128 (one split, two waves of programs), 0.080 against 0.085 at B = 64 (one split, one
wave); at 16 blocks a program it gains 2% at B = 96 (two splits, three waves: 0.145 against 0.148) and loses 1.4% at B =
32 (two splits, one wave: 0.0504 against 0.0497). So `auto` takes it for programs of 32 blocks or more;
`bench/dsa_kernels.py --check --only mla_decode --mla-batches 128` then gives 0.156 ms, 51% of the byte floor. As built
at 4adfa68 the seesaw lowered on jax 0.10.2 and not on the GPU's 0.11.2 (the mbarriers' row indexed with a scalar that
the wgmma blocks captured); found with `.venv-aot-0.11.2` (docs/development.md) before any device call ran it.

Variants of the owner schedule measured and removed (one run each, H100, B = 128, `bash bench/lab/h200_runs.sh
mla_seesaw` at 03bb1d8 against 0.171 ms for it; the code is in 03bb1d8): the slot in 2 or 4 parts, each gathered,
published and freed on its own so that S starts on a block's first part (0.175 / 0.172 ms); warpgroup 0 issuing the next
block's S right behind its P V (0.179; with 2 parts 0.172). The rows copied but never waited for take as long as the
whole kernel (0.172), where the compute alone takes 0.145 and the gathers alone 0.137: what the kernel loses to its
gathers is their traffic beside the tensor cores' reads, not their latency, so reordering the waits cannot win it back.
The one setting ahead is warpgroup 0 on 192 of the value columns (`OWNER_COLUMNS`, 240 / 224 registers), in three runs
on H100s: 0.168 / 0.168 / 0.162 ms against 0.171 / 0.172 / 0.168 (03bb1d8 / b0762fa / 51e2295); not yet timed on the
H200, whose figures the default keeps until it is.

Registers: the producer gives back all but 40 a thread; warpgroup 0 takes 256 and warpgroup 1 200. ptxas
(`tools/aot_h200.py`) then reports 28 bytes of spills, where 232 each spilled 136 (warpgroup 0's loop-invariant
wgmma descriptors, reloaded every block, and mostly from L2: ncu saw a 16% L1 hit rate).

`interpret=True` runs it in Mosaic GPU's interpreter (CPU, jax 0.10 included) with the GPU-only operations (the
inline cp.async gather, register layouts, wgmma) replaced by copies, loads and dots of whole refs (`_Interpreted`):
the interpreter runs the warpgroups as threads and checks their barriers, and its race detector the shared-memory
accesses that these order, so the tests check the protocol and the arithmetic on CPU; the gather's addressing and
the wgmma operands are checked on the GPU only.

Decode batches too small to fill the GPU split each list (flash-decoding): each split writes its normalised output
and log-sum-exp, combined in XLA by `sparse_mla_attention._combine_splits`, as in the Triton kernel.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._dispatch import num_sms
from ._mosaic import CompiledOps, InterpretedOps, interpret_option, mosaic_gpu

HEADS = 64  # heads a program: wgmma's M
BLOCK_KEYS = 64  # keys a block: S's N, and P V's K
SLOTS = 2  # row slots in flight
LATENT = 512  # value columns (Dl)
WIDTH = 576  # a latent row: Dl + Dr
# How the compute warpgroups split the work: "owner" (`_owner_schedule`), "seesaw" (`_seesaw_schedule`), or "auto":
# the seesaw for programs that walk SEESAW_MIN_BLOCKS blocks or more, where it led on the H200 at B = 128 and 64 (32
# blocks a program; 0.159 against 0.166 ms, 0.080 against 0.085) and in every H100 run at B = 128, and the owner
# schedule for shorter ones, where the seesaw's fill and drain of its pairs can cost more than it wins (B = 32, two
# splits of 16 blocks: 0.0504 against 0.0497); `schedule_for`.
SCHEDULE = "auto"
SEESAW_MIN_BLOCKS = 32
OWNER_COLUMNS = 256  # value columns warpgroup 0 (the softmax owner) accumulates, the first ones; warpgroup 1 the rest
OWNER_REGISTERS, SECOND_REGISTERS, PRODUCER_REGISTERS = 256, 200, 40  # a thread's, set_max_registers
WGMMA_MAX_N = 256
# The gather's copies with L2 prefetch and evict-last hints (`_copy_with_l2_hints`). The owner schedule runs with
# them (H200, eae4f4d, `mla_split`: 0.160 ms at B = 128, where it took 0.166 without them in a process of its own);
# the seesaw with them stopped on an illegal instruction in every run (H100 and H200, with the producer on 40 or 64
# registers), cause not found, so `sparse_mla_decode_mosaic` refuses that pair.
GATHER_L2_HINTS = False
P_COLUMNS = pl.ds(LATENT, WIDTH - LATENT)  # a slot's rope columns, where P ([64 heads, 64 keys]) goes after S
TILE_COLUMNS = 64  # bf16 columns of one 128-byte swizzle atom
PIECE = 8  # bf16 values a cp.async moves (16 bytes)
PRODUCER_THREADS = 128
CHUNKS = TILE_COLUMNS // PIECE  # 16-byte chunks in a tile's row: the producer threads that copy a row
ROWS_PER_PASS = PRODUCER_THREADS // CHUNKS
PASSES = BLOCK_KEYS // ROWS_PER_PASS  # rows (and keys) a producer thread copies a block
KEYS_HELD = PRODUCER_THREADS * PASSES  # the producer's keys of a block, as an array strided over its threads
MIN_BLOCKS_PER_SPLIT = 4  # a split's blocks at least: the two slots' pipeline needs a few to fill
LOG2E = math.log2(math.e)


def mosaic_problem(heads: int, width: int, latent: int, *dtypes) -> str | None:
    """Why this kernel cannot take these shapes and dtypes (of the query and the cache), or None."""
    if heads % HEADS:
        return f"heads={heads} is not a multiple of {HEADS}"
    if (width, latent) != (WIDTH, LATENT):
        return f"latent rows of {width} with {latent} value columns (the kernel is laid out for {WIDTH} / {LATENT})"
    for dtype in dtypes:
        if jnp.dtype(dtype) != jnp.bfloat16:
            return f"{jnp.dtype(dtype)} operands (the kernel takes bf16 queries and cache)"
    return None


def decode_splits(num_queries: int, heads: int, topk: int) -> int:
    """How many programs share one query's list (each at least MIN_BLOCKS_PER_SPLIT blocks): the fewest that
    minimise the blocks an SM walks. A program takes an SM's whole shared memory, so the programs run in waves of one
    per SM, and a wave takes as long as a program's blocks: at B=32 (64 programs a split) two splits run in one wave
    of 16 blocks, where three would run two waves of 11."""
    programs = num_queries * (heads // HEADS)
    blocks = pl.cdiv(topk, BLOCK_KEYS)
    most = max(1, blocks // MIN_BLOCKS_PER_SPLIT)

    def walked(splits):  # blocks an SM walks: waves x blocks a program
        return pl.cdiv(programs * splits, num_sms()) * pl.cdiv(blocks, splits)

    return min(range(1, most + 1), key=lambda splits: (walked(splits), splits))


def schedule_for(topk: int, splits: int) -> str:
    """The schedule (`SCHEDULE`) of programs that walk a split of a top-`topk` list cut in `splits`."""
    if SCHEDULE not in ("owner", "seesaw", "auto"):
        raise ValueError(f"sparse_mla_mosaic.SCHEDULE = {SCHEDULE!r}: not owner, seesaw or auto")
    if SCHEDULE != "auto":
        return SCHEDULE
    return "seesaw" if pl.cdiv(topk, splits * BLOCK_KEYS) >= SEESAW_MIN_BLOCKS else "owner"


def second_pieces() -> list[tuple[int, int]]:
    """Warpgroup 1's value columns (those after OWNER_COLUMNS) as (start, width) pieces of one wgmma each."""
    return [(start, min(WGMMA_MAX_N, LATENT - start)) for start in range(OWNER_COLUMNS, LATENT, WGMMA_MAX_N)]


def _thread_rows():
    """The producer thread's part of a block's gather: eight threads a row, thread `lane` of a row copying its
    16-byte chunks lane, lane + 8, ..., lane + 64 (one per 64-column tile), so that each copy instruction of a warp
    reads 128 contiguous bytes of each of 4 rows; 16 rows a pass, 4 passes a block. Returns (thread, lane, the
    thread's row of each pass) as i32 values."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu

    i32 = ir.IntegerType.get_signless(32)
    thread = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), mu.c(PRODUCER_THREADS, i32))
    lane = arith.remui(thread, mu.c(CHUNKS, i32))
    row_in_pass = arith.divui(thread, mu.c(CHUNKS, i32))
    rows = [arith.addi(mu.c(step * ROWS_PER_PASS, i32), row_in_pass) for step in range(PASSES)]
    return thread, lane, rows


def _global_pointer(ref):
    """An LLVM pointer to a GMEM ref, in the global address space (GMEM refs come in the generic one)."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir.dialects import llvm

    pointer = mu.memref_ptr(ref)
    if llvm.PointerType(pointer.type).address_space != 1:
        pointer = llvm.addrspacecast(llvm.PointerType.get(1), pointer)
    return pointer


def _load_thread_keys(indices_ref, first):
    """Emitted by the producer warpgroup: the indices of this thread's rows of the block that starts at
    indices_ref[first], as a [KEYS_HELD] array strided over the warpgroup (a thread's keys in its one vector
    register)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    _, _, rows = _thread_rows()
    index = ir.IndexType.get()
    keys = [memref.load(indices_ref, [arith.index_cast(index, arith.addi(first, row))]) for row in rows]
    registers = np.empty((1,), dtype=object)
    registers[0] = vector.from_elements(ir.VectorType.get((PASSES,), ir.IntegerType.get_signless(32)), keys)
    return mgpu.FragmentedArray(_registers=registers, _layout=mgpu.WGStridedFragLayout((KEYS_HELD,), PASSES),
                                _is_signed=True)


def _gather_block(table_ref, indices_ref, first, keys, rows_ref, index_ref,
                  tiles: range = range(WIDTH // TILE_COLUMNS)):
    """Emitted by the producer warpgroup (inside `plgpu.inline_mgpu`): cp.async copies of the 64 rows
    table_ref[indices_ref[first + i]] into rows_ref ([64, 576] in 8 x 64 tiles, 128-byte swizzle), zeros for a −1
    index, and of the 64 indices into index_ref (None: not copied). `tiles`: the 64-column tiles copied (all, or
    one half of the row for the seesaw schedule). `keys`: this thread's rows' indices (`_load_thread_keys`, loaded
    ahead). One commit group; the caller waits for it."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, nvvm, vector

    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    tiles_per_row = WIDTH // TILE_COLUMNS
    thread, lane, rows_of_thread = _thread_rows()
    table, indices = _global_pointer(table_ref), _global_pointer(indices_ref)
    rows = mu.memref_ptr(rows_ref)
    [key_vector] = keys.registers.flat
    keys = [vector.extract(key_vector, [], [step]) for step in range(PASSES)]

    # In the wgmma layout (8-row tiles of 64 columns, 1 KiB each, row-major over [row / 8, column / 64]) row r's
    # chunk c of a tile sits at chunk c ^ (r % 8) (the 128-byte swizzle): the same for all of a thread's copies of a
    # row, which sit 1 KiB apart. A pass covers whole tiles, so the row's place in its tile is the same every pass.
    in_tile = arith.remui(rows_of_thread[0], mu.c(8, i32))
    chunk_offset = arith.addi(arith.muli(in_tile, mu.c(128, i32)),
                              arith.muli(arith.xori(lane, in_tile), mu.c(16, i32)))

    policy = _evict_last_policy() if GATHER_L2_HINTS else None

    def copy_row(row, key):
        listed = arith.cmpi(arith.CmpIPredicate.sge, key, mu.c(0, i32))
        size = arith.select(listed, mu.c(16, i32), mu.c(0, i32))  # a −1 index: zeros
        key = arith.select(listed, key, mu.c(0, i32))
        source = mu.getelementptr(table, [arith.addi(arith.muli(arith.extui(i64, key), mu.c(WIDTH, i64)),
                                                     arith.extui(i64, arith.muli(lane, mu.c(PIECE, i32))))],
                                  ir.BF16Type.get())
        tile_row = arith.muli(arith.divui(row, mu.c(8, i32)), mu.c(tiles_per_row * 1024, i32))
        target = mu.getelementptr(rows, [arith.addi(tile_row, chunk_offset)], ir.IntegerType.get_signless(8))
        for tile in tiles:
            copy = _copy_with_l2_hints if GATHER_L2_HINTS else _copy
            copy(mu.getelementptr(target, [tile * 1024], ir.IntegerType.get_signless(8)),
                 mu.getelementptr(source, [tile * TILE_COLUMNS], ir.BF16Type.get()), size, policy)

    for row, key in zip(rows_of_thread, keys):
        copy_row(row, key)

    if index_ref is None:
        nvvm.cp_async_commit_group()
        return
    # The 64 indices (256 bytes): 16 threads, 16 bytes each.
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, thread, mu.c(BLOCK_KEYS * 4 // 16, i32))):
        source = mu.getelementptr(indices, [arith.extui(i64, arith.addi(first, arith.muli(thread, mu.c(4, i32))))],
                                  i32)
        target = mu.getelementptr(mu.memref_ptr(index_ref), [arith.muli(thread, mu.c(4, i32))], i32)
        nvvm.cp_async_shared_global(target, source, 16, nvvm.LoadCacheModifierKind.CG)
    nvvm.cp_async_commit_group()


def _copy(target, source, size, policy):
    """cp.async of 16 bytes (`size` 0: zeros), through L2 only (.cg): each row is read once by a program."""
    from jaxlib.mlir.dialects import nvvm

    del policy
    nvvm.cp_async_shared_global(target, source, 16, nvvm.LoadCacheModifierKind.CG, cp_size=size)


def _copy_with_l2_hints(target, source, size, policy):
    """`_copy` with FlashMLA's hints: L2 prefetches the 256 bytes around the source (a row is copied in 128-byte
    pieces, one copy instruction of the warp each), and keeps the rows with `policy` (evict last: the query's other
    head block, running beside this one, reads them too)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    llvm.inline_asm(ir.Type.parse("!llvm.void"),
                    [llvm.ptrtoint(i32, target), llvm.ptrtoint(i64, source), size, policy],
                    "cp.async.cg.shared.global.L2::cache_hint.L2::256B [$0], [$1], 16, $2, $3;", "r,l,r,l",
                    has_side_effects=True)


def _evict_last_policy():
    """An L2 cache policy (createpolicy): evict the lines it covers last."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import llvm

    return llvm.inline_asm(ir.IntegerType.get_signless(64), [],
                           "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l", has_side_effects=True)


def _wait_for_gathers(pending: int):
    """Emitted inline: wait until at most `pending` of this thread's cp.async groups are in flight."""
    from jaxlib.mlir.dialects import nvvm

    nvvm.cp_async_wait_group(pending)


def _tiles_of(columns) -> range:
    """The 64-column tiles of a row that `columns` (a pl.ds of whole tiles, or None: the whole row) covers."""
    if columns is None:
        return range(WIDTH // TILE_COLUMNS)
    assert columns.start % TILE_COLUMNS == 0 and columns.size % TILE_COLUMNS == 0, columns
    return range(columns.start // TILE_COLUMNS, (columns.start + columns.size) // TILE_COLUMNS)


class _Compiled(CompiledOps):
    """The kernel's operations on the GPU: `CompiledOps` and the cp.async gather."""

    def __init__(self, tiles):
        super().__init__()
        self.tiles = tiles

    def load_keys(self, indices_gmem, start):
        """This thread's keys of the block that starts at indices[start], for `gather`: loaded ahead, so that the
        gather's copies do not wait for them."""
        plgpu = self.plgpu

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT),
                           return_type=plgpu.ShapeDtypeStruct((KEYS_HELD,), jnp.int32,
                                                              plgpu.Layout.WG_STRIDED((KEYS_HELD,), PASSES)))
        def _load(ctx, indices_ref, first):
            del ctx
            return _load_thread_keys(indices_ref, first.registers.item())

        return _load(indices_gmem, start)

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref, columns=None):
        """Starts copying rows cache[indices[start:start + 64]] (zeros for −1) into rows_ref, and those indices
        into index_ref (None: not copied); `keys` are `load_keys(indices_gmem, start)`; `columns` (a pl.ds of whole
        64-column tiles): only those columns of the rows. `wait_for_gathers` completes them."""
        plgpu = self.plgpu
        tiles = _tiles_of(columns)
        arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                     plgpu.Layout.WG_STRIDED((KEYS_HELD,), PASSES), plgpu.RefType(self.tiles))
        args = (cache_gmem, indices_gmem, start, keys, rows_ref)
        if index_ref is not None:
            arg_types, args = arg_types + (plgpu.RefType(),), args + (index_ref,)

        @plgpu.inline_mgpu(arg_types=arg_types)
        def _gather(ctx, table_ref, indices_ref, first, keys, rows, indices_slot=None):
            del ctx
            _gather_block(table_ref, indices_ref, first.registers.item(), keys, rows, indices_slot, tiles)

        _gather(*args)

    def wait_for_gathers(self, pending: int):
        """Waits until at most `pending` of this thread's gathers are in flight."""
        self.plgpu.inline_mgpu()(lambda ctx: _wait_for_gathers(pending))()

    def landed_halves(self, barriers, smem):
        del barriers  # the interpreter's
        return _LandedByCopies(self.plgpu, smem)


class _Interpreted(InterpretedOps):
    """The kernel's operations in Mosaic GPU's interpreter (CPU), which has no rule for inline Mosaic GPU code: the
    gather copies row by row, of the keys loaded ahead (a [64] array). The interpreter checks the rest of the kernel
    as the GPU runs it: the warpgroups, their barriers (every phase observed by each waiter), the slots, the indexing
    and the softmax."""

    def load_keys(self, indices_gmem, start):
        return indices_gmem[pl.ds(start, BLOCK_KEYS)]

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref, columns=None):
        if index_ref is not None:
            index_ref[...] = indices_gmem[pl.ds(start, BLOCK_KEYS)]
        columns = pl.ds(0, WIDTH) if columns is None else columns

        @pl.loop(0, BLOCK_KEYS)
        def _row(i):
            key = keys[i]
            row = cache_gmem[jnp.maximum(key, 0), columns]
            rows_ref[i, columns] = jnp.where(key >= 0, row, jnp.zeros_like(row))

    def wait_for_gathers(self, pending: int):
        del pending  # the copies above are done when they return

    def landed_halves(self, barriers, smem):
        del smem  # the GPU's
        return _LandedByBarriers(barriers)


class _LandedByCopies:
    """The seesaw's half slots' "landed" barriers on the GPU: mbarriers in shared memory (`smem`, 8 bytes each, int32
    pairs) that each producer thread's copies arrive on themselves once they have landed
    (`cp.async.mbarrier.arrive.noinc`, as in FlashMLA), so that the producer never waits for its copies. Pallas'
    barriers cannot take such an arrival (inline Mosaic GPU code gets refs and arrays, not barriers), hence these,
    initialised, arrived at and waited on in inline code. A half slot's barrier completes once a pair: its waiters
    pass the pair's parity."""

    TICKS = 10_000_000  # a try_wait's suspend-time hint, as Mosaic GPU's own waits give it

    def __init__(self, plgpu, smem):
        self.plgpu, self.smem = plgpu, smem

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
        def _init(ctx, ref):
            from jax.experimental.mosaic.gpu import utils as mu
            from jaxlib.mlir import ir
            from jaxlib.mlir.dialects import gpu, nvvm

            del ctx
            # One thread initialises them, for the producer's 128 arrivals a phase; the block's barrier makes them
            # initialised for every warpgroup before any waits on them.
            one = mu.single_thread_predicate(scope=mu.ThreadSubset.BLOCK)
            for index in range(SLOTS * HALVES):
                nvvm.mbarrier_init(self._pointer(ref, index), mu.c(PRODUCER_THREADS, ir.IntegerType.get_signless(32)),
                                   predicate=one)
            nvvm.fence_mbarrier_init()
            gpu.barrier()

        _init(smem)

    @staticmethod
    def _pointer(ref, index):
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir

        return mu.getelementptr(mu.memref_ptr(ref), [index], ir.IntegerType.get_signless(64))

    def arrive(self, index: int):
        """Emitted by the producer, every thread, after a half slot's copies: the thread's arrival once they (and
        all its earlier ones) have landed."""
        from jaxlib.mlir.dialects import nvvm

        @self.plgpu.inline_mgpu(arg_types=(self.plgpu.RefType(),))
        def _arrive(ctx, ref):
            del ctx
            nvvm.cp_async_mbarrier_arrive(self._pointer(ref, index), noinc=True)

        _arrive(self.smem)

    def wait(self, index: int, pair):
        """Emitted by a compute warpgroup: waits until the half slot's rows of `pair` have landed. The copies wrote
        them through the generic proxy and wgmma reads them through the async one: the fence orders the two."""
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, nvvm

        plgpu = self.plgpu

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
        def _wait(ctx, ref, pair_value):
            del ctx
            i32 = ir.IntegerType.get_signless(32)
            parity = arith.andi(pair_value.registers.item(), mu.c(1, i32))
            nvvm.mbarrier_try_wait_parity(self._pointer(ref, index), parity, mu.c(self.TICKS, i32))
            nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

        _wait(self.smem, jnp.asarray(pair, jnp.int32))


class _LandedByBarriers:
    """`_LandedByCopies` in the interpreter, whose copies are done when the gather returns: the producer arrives on a
    Pallas barrier after them, and the interpreter checks that every waiter observes every phase."""

    def __init__(self, barriers):
        self.plgpu, self.barriers = mosaic_gpu(), barriers

    def arrive(self, index: int):
        self.plgpu.barrier_arrive(self.barriers.at[index])

    def wait(self, index: int, pair):
        del pair
        self.plgpu.barrier_wait(self.barriers.at[index])


def sparse_mla_decode_mosaic(q, flat_cache, indices, *, scale: float, listed=None, num_splits: int | None = None,
                             interpret=False):
    """See the module docstring. `listed` (int32[T], optional): how many entries lead each list before its −1
    padding (the indexer's layout); blocks past them are not gathered. Without it every block is. `interpret`: run
    in Mosaic GPU's interpreter (True, or its `InterpretGPUParams`), see `_Interpreted`."""
    plgpu = mosaic_gpu()
    T, H, D = q.shape
    topk = indices.shape[1]
    problem = mosaic_problem(H, D, LATENT, q.dtype, flat_cache.dtype)
    if problem:
        raise ValueError(f"sparse_mla_decode_mosaic: {problem}")
    splits = decode_splits(T, H, topk) if num_splits is None else num_splits
    seesaw = schedule_for(topk, splits) == "seesaw"
    if seesaw and GATHER_L2_HINTS:
        raise ValueError("sparse_mla_decode_mosaic: GATHER_L2_HINTS with the seesaw schedule stops the GPU on an "
                         "illegal instruction; set SCHEDULE = 'owner' for the hints")
    walked = BLOCK_KEYS * (SLOTS if seesaw else 1)  # the seesaw walks its blocks in pairs
    split_len = pl.cdiv(pl.cdiv(topk, splits), walked) * walked
    padded = splits * split_len
    indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, padded - topk)), constant_values=-1)
    listed = jnp.full((T,), topk, jnp.int32) if listed is None else jnp.clip(listed.astype(jnp.int32), 0, topk)
    scale_log2 = float(scale) * LOG2E  # scores in base 2: exp2 is one instruction
    tiles = (plgpu.TilingTransform((8, TILE_COLUMNS)), plgpu.SwizzleTransform(128))
    ops = _Interpreted() if interpret else _Compiled(tiles)

    def kernel(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem, scratch):
        head_block, split, t = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("t")
        heads = pl.ds(head_block * HEADS, HEADS)
        first = split * split_len
        count = listed_gmem[t]
        in_split = jnp.clip(count - first, 0, split_len)
        program = _Program(ops, plgpu, t=t, split=split, heads=heads, row_base=t * padded + first, in_split=in_split,
                           opaque_zero=count >> 30,  # counts are in [0, topk]
                           scale_log2=scale_log2, cache_gmem=cache_gmem, indices_gmem=indices_gmem,
                           q_gmem=q_gmem, out_gmem=out_gmem, lse_gmem=lse_gmem)
        (_seesaw_schedule if seesaw else _owner_schedule)(program, *scratch)

    def entry(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem=None):
        pl.run_scoped(
            lambda *scratch: kernel(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem, scratch),
            *(_seesaw_scratch if seesaw else _owner_scratch)(plgpu, tiles),
            collective_axes="wg",
        )

    split_out = splits > 1
    out_type = [jax.ShapeDtypeStruct((T, splits, H, LATENT), jnp.float32 if split_out else q.dtype)]
    if split_out:
        out_type.append(jax.ShapeDtypeStruct((T, splits, H), jnp.float32))
    call = plgpu.kernel(
        # The last grid axis varies fastest in launch order (Mosaic GPU maps it to CUDA's x): a query's head blocks
        # run side by side and read its rows once from HBM, the second from L2. With the heads first, the two were
        # a wave apart and read 540 MB at B=128 where the rows are 302 (ncu, `h200_runs.sh mla_ncu_mosaic`).
        entry, out_type=tuple(out_type), grid=(T, splits, H // HEADS), grid_names=("t", "s", "h"),
        num_threads=3, thread_name="wg",
        # The seesaw's shared memory leaves no room for Pallas' 2 KiB of cross-warp reduction scratch, which its
        # reductions (over the columns of wgmma's layout, within a warp) do not use.
        compiler_params=plgpu.CompilerParams(approx_math=True, **({"reduction_scratch_bytes": 0} if seesaw else {})),
        **interpret_option(interpret))
    outs = call(listed, q, flat_cache, indices.reshape(-1))
    if not split_out:
        return outs[0][:, 0]
    from .sparse_mla_attention import _combine_splits  # here: that module imports this one

    return _combine_splits(outs[0], outs[1], q.dtype)


class _Program:
    """What both schedules' warpgroups share in a program (a query's head block and split of its list): where its
    query, rows and output are, and the scores' masking and the output's normalisation."""

    def __init__(self, ops, plgpu, *, t, split, heads, row_base, in_split, opaque_zero, scale_log2, cache_gmem,
                 indices_gmem, q_gmem, out_gmem, lse_gmem):
        self.ops, self.plgpu = ops, plgpu
        self.opaque_zero = opaque_zero  # 0, loaded from memory: LLVM cannot fold it
        self.t, self.split, self.heads, self.row_base, self.in_split = t, split, heads, row_base, in_split
        self.blocks = (in_split + BLOCK_KEYS - 1) // BLOCK_KEYS
        self.scale_log2 = scale_log2
        self.cache_gmem, self.indices_gmem, self.q_gmem = cache_gmem, indices_gmem, q_gmem
        self.out_gmem, self.lse_gmem = out_gmem, lse_gmem

    def wg(self):
        return lax.axis_index("wg")

    def keys_of(self, block, walked):
        """The producer thread's keys of `block` (clamped to the `walked` blocks: past them loaded, not used)."""
        block = jnp.clip(block, 0, jnp.maximum(walked - 1, 0))
        return self.ops.load_keys(self.indices_gmem, self.row_base + block * BLOCK_KEYS)

    def gather(self, block, keys, rows_ref, index_ref, columns=None):
        self.ops.gather(self.cache_gmem, self.indices_gmem, self.row_base + block * BLOCK_KEYS, keys, rows_ref,
                        index_ref, columns)

    def masked_scores(self, s, index_ref, block):
        """S of `block` in base 2, −inf where a key does not count: −1, or not listed (at or past `listed`)."""
        key = self.ops.load(index_ref, self.plgpu.Layout.WGMMA.reduce(0))
        position = self.ops.with_layout(lax.broadcasted_iota(jnp.int32, (BLOCK_KEYS,), 0),
                                        self.plgpu.Layout.WGMMA.reduce(0))
        counts = (key >= 0) & (position < self.in_split - block * BLOCK_KEYS)
        return jnp.where(lax.broadcast_in_dim(counts, s.shape, [1]), s * self.scale_log2, -jnp.inf)

    def rows_vector(self, value):
        """`value` ([64]) in the layout of S's rows (a value a head)."""
        return self.ops.with_layout(value, self.plgpu.Layout.WGMMA.reduce(1))

    def load_rows_vector(self, ref):
        return self.ops.load(ref, self.plgpu.Layout.WGMMA.reduce(1))

    def finish(self, acc, total, columns):
        """Normalise this warpgroup's output columns and store them."""
        some = total > 0
        out = _rescale(acc, jnp.where(some, 1.0 / jnp.where(some, total, 1.0), 0.0))
        self.out_gmem[self.t, self.split, self.heads, columns] = out.astype(self.out_gmem.dtype)

    def store_lse(self, m, total):
        if self.lse_gmem is not None:
            some = total > 0
            lse = jnp.where(some, (m + jnp.log2(jnp.where(some, total, 1.0))) / LOG2E, -jnp.inf)
            self.lse_gmem[self.t, self.split, self.heads] = lse


def _rescale(array, factor):
    return array * lax.broadcast_in_dim(factor, array.shape, [0])


def _safe_max(m):
    """The row maximum to subtract: 0 where every key so far is none (−inf), so that exp2 stays finite."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _online_softmax(s, m, m_new, total):
    """The online softmax's step to the row maximum m_new from m: P = exp2(S - m_new), the factor that rescales
    what was summed at m, and the row sums with P's added."""
    m_safe = _safe_max(m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
    return p, alpha, total * alpha + p.sum(axis=1)


def _owner_scratch(plgpu, tiles):
    return (plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=tiles),
            plgpu.SMEM((SLOTS, BLOCK_KEYS, WIDTH), jnp.bfloat16, transforms=tiles),
            plgpu.SMEM((SLOTS, BLOCK_KEYS), jnp.int32),
            plgpu.SMEM((SLOTS, HEADS), jnp.float32),
            plgpu.SMEM((1, HEADS), jnp.float32),
            (plgpu.Barrier(num_barriers=SLOTS),  # rows_ready: the producer's arrival
             plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),  # rows_free: both compute warpgroups
             plgpu.Barrier(num_barriers=SLOTS),  # p_ready: warpgroup 0's P and rescale of the slot's block
             plgpu.Barrier(),  # q_ready (TMA)
             plgpu.Barrier()))  # done: warpgroup 0's row sums are in stats_smem


def _owner_schedule(program, q_smem, rows_smem, index_smem, alpha_smem, stats_smem, barriers):
    """Warpgroup 0 owns the softmax (S, the online softmax and O[:, :OWNER_COLUMNS]); warpgroup 1 adds P V into the
    other columns; the producer gathers a block a slot (module docstring)."""
    rows_ready, rows_free, p_ready, q_ready, done = barriers
    ops, plgpu, blocks = program.ops, program.plgpu, program.blocks
    wg = program.wg()

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def publish(block):
            # Each thread's copies are complete (cp.async.wait_group); the fence orders them before the
            # warpgroup's arrival for the tensor cores' reads (the async proxy).
            plgpu.commit_smem()
            plgpu.barrier_arrive(rows_ready.at[block % SLOTS])

        def gather(block, keys):
            program.gather(block, keys, rows_smem.at[block % SLOTS], index_smem.at[block % SLOTS])

        def keys_of(block):
            # A block's keys are loaded a block ahead of its gather, so that the gather's copies go out without
            # waiting for them (H200, B=128: 0.174 -> 0.170 ms; B=32 0.052 -> 0.050).
            return program.keys_of(block, blocks)

        @pl.when(blocks >= 1)
        def _():
            gather(0, keys_of(0))

        # Each block is published as soon as its rows have landed, and the next gather waits for its slot
        # only after that: a block's publication never waits behind the gather of the one after it. The two
        # slots' blocks go out together first. The other order, each gather issued as soon as its slot is free
        # and before the previous block's publication (two gathers in flight), was slower on the H200 (B=128:
        # 0.183 ms against 0.170 at dd9c7de), a sign that the gathers keep up (`h200_runs.sh mla_split` times
        # each part).
        @pl.when(blocks >= 2)
        def _():
            gather(1, keys_of(1))
            ops.wait_for_gathers(1)
            publish(0)

        @pl.when(blocks == 1)
        def _():
            ops.wait_for_gathers(0)
            publish(0)

        def step(block, keys):  # keys: block + 1's
            ops.wait_for_gathers(0)
            publish(block)

            @pl.when(block + 1 < blocks)
            def _():
                plgpu.barrier_wait(rows_free.at[(block + 1) % SLOTS])  # block - 1 is done with it
                gather(block + 1, keys)

            return keys_of(block + 2)

        lax.fori_loop(1, blocks, step, keys_of(2))

        # The compute warpgroups free each slot once a block; the last SLOTS freeings are waited for too, so
        # that every waiter observes every phase of its barriers (the interpreter checks it; on the GPU it only
        # keeps the idle producer until the end).
        @pl.loop(jnp.maximum(blocks - SLOTS, 0), blocks)
        def _drain(block):
            plgpu.barrier_wait(rows_free.at[block % SLOTS])

    @pl.when(wg == 0)
    def _softmax_owner():
        # The softmax owner holds the most live values (its half of O, S, P, the wgmma descriptors): at 232
        # registers a thread it spilled 136 bytes, reloaded from local memory every block (L1 hit rate 16%
        # there, ncu); at 256, 28 (`tools/aot_h200.py`). 256 + 200 + the producer's 40 fit the 64K registers.
        plgpu.set_max_registers(OWNER_REGISTERS, action="increase")
        plgpu.copy_gmem_to_smem(program.q_gmem.at[program.t, program.heads], q_smem, q_ready)
        plgpu.barrier_wait(q_ready)
        m = program.rows_vector(jnp.full((HEADS,), -jnp.inf, jnp.float32))
        total = program.rows_vector(jnp.zeros((HEADS,), jnp.float32))
        acc = ops.with_layout(jnp.zeros((HEADS, OWNER_COLUMNS), jnp.float32), plgpu.Layout.WGMMA)

        def block_step(block, carry):
            acc, m, total = carry
            slot = block % SLOTS
            plgpu.barrier_wait(rows_ready.at[slot])
            s = program.masked_scores(ops.matmul_transposed(q_smem, rows_smem.at[slot]), index_smem.at[slot], block)
            m_new = jnp.maximum(m, s.max(axis=1))
            p, alpha, total = _online_softmax(s, m, m_new, total)
            p16 = p.astype(jnp.bfloat16)
            # P goes where the slot's rope columns were (read by S only, which is done): no buffer of its own,
            # and the slot is refilled only once both warpgroups are done with it.
            rows_smem[slot, :, P_COLUMNS] = p16
            alpha_smem[slot] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[slot])
            acc = ops.accumulate(_rescale(acc, alpha), p16, rows_smem.at[slot, :, pl.ds(0, OWNER_COLUMNS)])
            plgpu.barrier_arrive(rows_free.at[slot])
            return acc, m_new, total

        acc, m, total = lax.fori_loop(0, blocks, block_step, (acc, m, total))
        stats_smem[0] = total
        plgpu.commit_smem()
        plgpu.barrier_arrive(done)
        program.finish(acc, total, pl.ds(0, OWNER_COLUMNS))
        program.store_lse(m, total)

    @pl.when(wg == 1)
    def _second_warpgroup():
        plgpu.set_max_registers(SECOND_REGISTERS, action="increase")
        pieces = second_pieces()  # one wgmma each
        accs = tuple(ops.with_layout(jnp.zeros((HEADS, width), jnp.float32), plgpu.Layout.WGMMA)
                     for _, width in pieces)

        def block_step(block, accs):
            slot = block % SLOTS
            plgpu.barrier_wait(rows_ready.at[slot])
            plgpu.barrier_wait(p_ready.at[slot])
            alpha = program.load_rows_vector(alpha_smem.at[slot])
            p16 = rows_smem.at[slot, :, P_COLUMNS]
            accs = tuple(ops.accumulate(_rescale(acc, alpha), p16, rows_smem.at[slot, :, pl.ds(start, width)])
                         for acc, (start, width) in zip(accs, pieces))
            plgpu.barrier_arrive(rows_free.at[slot])
            return accs

        accs = lax.fori_loop(0, blocks, block_step, accs)
        plgpu.barrier_wait(done)
        total = program.load_rows_vector(stats_smem.at[0])
        for acc, (start, width) in zip(accs, pieces):
            program.finish(acc, total, pl.ds(start, width))


# The seesaw's half slots: the first 256 columns of a slot's rows (V's first half) and the rest (V's second half and
# the rope columns), each gathered, published and freed on its own; and each warpgroup's half of V (and of O).
HALF_SLOTS = (pl.ds(0, LATENT // 2), pl.ds(LATENT // 2, WIDTH - LATENT // 2))
HALVES = len(HALF_SLOTS)
V_HALVES = (pl.ds(0, LATENT // 2), pl.ds(LATENT // 2, LATENT // 2))
# The half slots (slot, half) by when their last reader frees them: slot 0's first half by warpgroup 0 after its own
# P V and slot 1's second half by warpgroup 1 after its own (mid-pair), the others after each warpgroup's P V with the
# other's P (at the pair's end). Each warpgroup's S of the next pair starts on the half freed mid-pair.
FREED_MID_PAIR, FREED_AT_PAIR_END = ((0, 0), (1, 1)), ((0, 1), (1, 0))
# Warpgroup 0, 1 and the producer: 504 x 128 = the launch's 64,512. ptxas spills 16 bytes (`tools/aot_h200.py --set
# SCHEDULE=seesaw`); while the producer waited for its copies it spilled 20 there (5 values of its loop) and none in
# the compute warpgroups, and at (232, 224, 48) 52 bytes there.
SEESAW_REGISTERS = (232, 232, 40)
# Warpgroup 0 issues the next pair's S behind its last P V of a pair, as FlashMLA does, rather than at the top of the
# next pair (`_seesaw_schedule`).
SEESAW_EARLY_S = True


def _seesaw_scratch(plgpu, tiles):
    return (plgpu.SMEM((1, HEADS, WIDTH), jnp.bfloat16, transforms=tiles),  # Q (indexed by `pair_zero`)
            plgpu.SMEM((SLOTS, BLOCK_KEYS, WIDTH), jnp.bfloat16, transforms=tiles),  # rows: even and odd blocks
            plgpu.SMEM((1, HEADS, BLOCK_KEYS), jnp.bfloat16, transforms=tiles),  # warpgroup 1's P (odd blocks)
            # Each slot's indices, and a row for the half slots' mbarriers on the GPU (`_LandedByCopies`): every
            # allocation takes whole KiB, and the indices leave half of theirs, where the shared memory is full.
            plgpu.SMEM((SLOTS + 1, BLOCK_KEYS), jnp.int32),
            plgpu.SMEM((3, HEADS), jnp.float32),  # the pair's row maximum, and each warpgroup's row sums
            (plgpu.Barrier(num_barriers=SLOTS * HALVES),  # half_ready[slot * 2 + half] (interpreter only)
             plgpu.Barrier(num_barriers=SLOTS * HALVES),  # half_free: its last reader's
             plgpu.Barrier(num_barriers=SLOTS),  # max_ready[slot]: the slot owner's row maximum is in stats[0]
             plgpu.Barrier(num_barriers=SLOTS),  # p_ready[slot]: the slot owner's P is stored
             plgpu.Barrier(),  # q_ready (TMA)
             plgpu.Barrier(num_arrivals=2)))  # sums_ready: both warpgroups' row sums are in stats[1:]


def _seesaw_schedule(program, q_smem, rows_smem, p_odd_smem, index_smem, stats_smem, barriers):
    """FlashMLA's sparse prefill schedule (its "seesaw"): the two compute warpgroups own a block each of a pair,
    warpgroup 0 the even one (slot 0) and 1 the odd one (slot 1), and each holds half of O (the first and last 256
    value columns). Each computes its block's S, and both warpgroups' tensor work is the same: S of one block and
    P V of both blocks over its half. The online softmax is one, in order: warpgroup 0's row maximum m0 (the even
    block) goes to warpgroup 1, whose m1 = max(m0, its block's) comes back; warpgroup 0 then rescales its P to m1
    before storing it. Warpgroup 0's P goes where slot 0's rope columns were, warpgroup 1's to a buffer of its own,
    since warpgroup 0 reads it after slot 1's second half is free. Each half slot is published by its copies as they
    land (`_LandedByCopies`) and freed by its last reader, so that the next pair's first halves are gathered while
    this pair is computed."""
    half_ready, half_free, max_ready, p_ready, q_ready, sums_ready = barriers
    ops, plgpu = program.ops, program.plgpu
    # Initialised here, by every warpgroup. The row is sliced, not indexed: an index is a scalar the kernel's
    # wgmma blocks (`pl.run_state`) would capture, which jax 0.11's lowering cannot hand back from them.
    landed = ops.landed_halves(half_ready, index_smem.at[pl.ds(SLOTS, 1)])
    # An odd last block is walked with a block of no keys (the lists are padded to pairs), and a split with no keys
    # walks one pair of them (all masked: zeros out, as with none walked), so that warpgroup 0's last pair, which
    # issues no next S, is always there. Written so, not as a maximum with 1: knowing the loops run at least once,
    # LLVM moved values out of them and ptxas spilled 48 bytes in the compute warpgroups.
    pairs = (program.blocks + 1) // 2 + (program.blocks == 0)
    walked = 2 * pairs
    wg = program.wg()

    def half(slot, part):
        """The half slot's index among the `landed` barriers, and its barrier of the readers' freeing."""
        return slot * HALVES + part, half_free.at[slot * HALVES + part]

    def pair_zero(pair):
        """0, computed from the pair so that LLVM cannot see it: the shared-memory operands are indexed with it,
        which keeps their wgmma descriptors (a 64-bit value per 16 columns of K: about 80 a warpgroup) in the loop.
        With constant indices LLVM hoisted them all out of it and ptxas spilled 1.4 KB a thread
        (`tools/aot_h200.py --set SCHEDULE=seesaw`); the owner schedule's slot alternates, and so its operands'
        descriptors stay in its loop (but Q's)."""
        return pair & program.opaque_zero

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(SEESAW_REGISTERS[2], action="decrease")

        def gather(slot, part, block, keys):
            # A slot's indices come with its second half, which S waits for last.
            program.gather(block, keys, rows_smem.at[slot], index_smem.at[slot] if part else None,
                           HALF_SLOTS[part])

        # FlashMLA's order: the halves freed mid-pair, then those freed at its end, each gathered as soon as it is
        # free. The producer never waits for its copies: each thread's copies arrive on the half's barrier once they
        # have landed (`landed`), so that a gather waits for nothing but its half slot's freeing.
        def pair_step(pair, keys):
            following = (program.keys_of(2 * pair + 2, walked), program.keys_of(2 * pair + 3, walked))
            for slot, part in FREED_MID_PAIR + FREED_AT_PAIR_END:
                ready, free = half(slot, part)

                @pl.when(pair > 0)
                def _():
                    plgpu.barrier_wait(free)

                gather(slot, part, 2 * pair + slot, keys[slot])
                landed.arrive(ready)
            return following

        lax.fori_loop(0, pairs, pair_step, (program.keys_of(0, walked), program.keys_of(1, walked)))

        # The last pair's freeings, waited for so that every waiter observes every phase (see `_owner_schedule`).
        for slot, part in FREED_MID_PAIR + FREED_AT_PAIR_END:
            plgpu.barrier_wait(half(slot, part)[1])

    def softmax_state():
        return (ops.with_layout(jnp.zeros((HEADS, LATENT // 2), jnp.float32), plgpu.Layout.WGMMA),
                program.rows_vector(jnp.full((HEADS,), -jnp.inf, jnp.float32)),
                program.rows_vector(jnp.zeros((HEADS,), jnp.float32)))

    def score_parts(slot, parts, pair):
        """The products that sum to the slot's S of `pair`, over its halves in `parts`' order, each issued once it
        has landed."""
        zero = pair_zero(pair)

        def product(part):
            columns = HALF_SLOTS[part]
            return (lambda: landed.wait(half(slot, part)[0], pair), q_smem.at[zero, :, columns],
                    rows_smem.at[slot + zero, :, columns])

        return [product(part) for part in parts]

    def scores(slot, block, parts, pair):
        """The slot's block's masked S."""
        s = ops.matmul_transposed_sum(score_parts(slot, parts, pair))
        return program.masked_scores(s, index_smem.at[slot], block)

    def publish_max(m_new, slot):
        """The row maximum so far, to the other warpgroup (stats[0])."""
        stats_smem[0] = m_new
        plgpu.commit_smem()
        plgpu.barrier_arrive(max_ready.at[slot])

    def finish(acc, m, total, wg_index):
        stats_smem[1 + wg_index] = total
        plgpu.commit_smem()
        plgpu.barrier_arrive(sums_ready)
        plgpu.barrier_wait(sums_ready)
        total = program.load_rows_vector(stats_smem.at[1]) + program.load_rows_vector(stats_smem.at[2])
        program.finish(acc, total, V_HALVES[wg_index])
        if wg_index == 0:
            program.store_lse(m, total)

    @pl.when(wg == 0)
    def _even_blocks():
        plgpu.set_max_registers(SEESAW_REGISTERS[0], action="increase")
        plgpu.copy_gmem_to_smem(program.q_gmem.at[program.t, program.heads], q_smem.at[0], q_ready)
        plgpu.barrier_wait(q_ready)

        def pair_step(pair, carry, *, s_carried: bool, issue_next: bool):
            """A pair. `s_carried`: the carry's last item is this pair's S (unmasked); `issue_next`: the next pair's
            comes back there (else None)."""
            acc, m, total, s = carry
            zero = pair_zero(pair)
            if s_carried:
                s = program.masked_scores(s, index_smem.at[0], 2 * pair)
            else:
                s = scores(0, 2 * pair, (0, 1), pair)
            m0 = jnp.maximum(m, s.max(axis=1))
            publish_max(m0, 0)
            p, alpha, total = _online_softmax(s, m, m0, total)
            acc = ops.accumulate(_rescale(acc, alpha), p.astype(jnp.bfloat16), rows_smem.at[zero, :, V_HALVES[0]])
            plgpu.barrier_arrive(half(0, 0)[1])
            # The pair's maximum, then this block's P at it, for warpgroup 1 (where slot 0's rope columns were).
            plgpu.barrier_wait(max_ready.at[1])
            m1 = program.load_rows_vector(stats_smem.at[0])
            beta = jnp.exp2(m0 - _safe_max(m1))
            rows_smem[0, :, P_COLUMNS] = _rescale(p, beta).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[0])

            def wait_for_odd_p():
                landed.wait(half(1, 0)[0], pair)
                plgpu.barrier_wait(p_ready.at[1])

            odd_product = (wait_for_odd_p, p_odd_smem.at[zero], rows_smem.at[1 + zero, :, V_HALVES[0]],
                           lambda: plgpu.barrier_arrive(half(1, 0)[1]))
            if issue_next:
                # The next pair's S goes to the tensor cores behind this P V: its first half has been gathered
                # since mid-pair; its second comes with the half this P V frees (FREED_AT_PAIR_END).
                acc, s = ops.accumulate_then_matmul_transposed(_rescale(acc, beta), odd_product,
                                                               score_parts(0, (0, 1), pair + 1))
            else:
                acc, s = ops.accumulate_sum(_rescale(acc, beta), [odd_product]), None
            return acc, m1, total * beta, s

        if SEESAW_EARLY_S:
            # The first pair's S before the loop, the last pair without a next one after it.
            first_s = ops.matmul_transposed_sum(score_parts(0, (0, 1), 0))
            carry = lax.fori_loop(0, pairs - 1,
                                  lambda pair, carry: pair_step(pair, carry, s_carried=True, issue_next=True),
                                  softmax_state() + (first_s,))
            acc, m, total, _ = pair_step(pairs - 1, carry, s_carried=True, issue_next=False)
        else:
            acc, m, total = lax.fori_loop(
                0, pairs, lambda pair, carry: pair_step(pair, carry + (None,), s_carried=False, issue_next=False)[:3],
                softmax_state())
        finish(acc, m, total, 0)

    @pl.when(wg == 1)
    def _odd_blocks():
        plgpu.set_max_registers(SEESAW_REGISTERS[1], action="increase")
        plgpu.barrier_wait(q_ready)
        second = V_HALVES[1]

        def pair_step(pair, carry):
            acc, m, total = carry
            zero = pair_zero(pair)
            s = scores(1, 2 * pair + 1, (1, 0), pair)
            plgpu.barrier_wait(max_ready.at[0])
            m1 = jnp.maximum(program.load_rows_vector(stats_smem.at[0]), s.max(axis=1))
            publish_max(m1, 1)
            p, alpha, total = _online_softmax(s, m, m1, total)
            p_odd_smem[0] = p.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[1])

            def wait_for_even_p():
                landed.wait(half(0, 1)[0], pair)
                plgpu.barrier_wait(p_ready.at[0])

            # Both products back to back, P from shared memory for both: the tensor cores do not drain between them.
            acc = ops.accumulate_sum(_rescale(acc, alpha), [
                (lambda: None, p_odd_smem.at[zero], rows_smem.at[1 + zero, :, second],
                 lambda: plgpu.barrier_arrive(half(1, 1)[1])),
                (wait_for_even_p, rows_smem.at[zero, :, P_COLUMNS], rows_smem.at[zero, :, second],
                 lambda: plgpu.barrier_arrive(half(0, 1)[1]))])
            return acc, m1, total

        acc, m, total = lax.fori_loop(0, pairs, pair_step, softmax_state())
        finish(acc, m, total, 1)
