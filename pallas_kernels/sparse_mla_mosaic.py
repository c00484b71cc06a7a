"""Sparse MLA decode for Hopper through Pallas' Mosaic GPU backend: FlashMLA's split of the work over warpgroups,
with the selected latent rows gathered into shared memory by `cp.async` (issue 42). `sparse_mla_attention`'s `auto`
takes it on Hopper. On the H200 at top-2048 and 128 heads: 0.017 / 0.050 / 0.170 ms at B = 1 / 32 / 128, against the
Triton kernel's 0.036 / 0.179 / 0.312; 47% of the byte floor at B = 128 (docs/BENCHMARKS.md). Prefill chunks (2,048
queries) take as long on either kernel: 4.85 ms.

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
computes S ("seesaw"), which needs each warpgroup's softmax to wait for the other's row maxima; this schedule
keeps one owner of the softmax state and relies on warpgroup 1's products filling the tensor cores while warpgroup 0
runs its softmax. At B = 128 on the H200 that leaves the tensor pipe busy 53% of the time, with DRAM at 31% of its
peak and L2 at 53% (Nsight Compute, `bash bench/lab/h200_runs.sh mla_ncu_mosaic`). More overlap in warpgroup 0 (the
seesaw, the slot in parts, an early S: below) has not paid. The next block's S issued before this block's softmax
would need a third row slot (with two, that block's rows could only be gathered once the slot of the block before
was free, just before they are needed), and shared memory holds two: the query block 72 KiB and two row slots of 72
KiB (226 KiB with Pallas' own, of the H200's 227).

FlashMLA's seesaw, as its sparse prefill kernel runs it (about 640 TFLOP/s on the H800, where this kernel does 430 on
the H200 at B = 128), was built here and removed after 51e2295, which holds it (`_seesaw_schedule`): the warpgroups
owned alternate blocks of a pair and half of O each, passing the pair's row maximum between them, and each half of a row
slot was gathered, published and freed on its own, so that the next pair's first halves were gathered while this pair
was computed. It passed the interpreter's tests and its compiled ones, and lost in every run (H100, B = 128, `bash
bench/lab/h200_runs.sh mla_seesaw` at acb2037, 03bb1d8, b0762fa and 51e2295, one run each): whole 0.193 / 0.192 / 0.193
/ 0.191 ms against this schedule's 0.174 / 0.171 / 0.172 / 0.168, though its compute alone was the faster (0.130 / 0.131
/ 0.137 at 03bb1d8 / b0762fa / 51e2295, against this schedule's 0.145 / 0.146 at the first two). Its gathers copied but
never waited for took 0.163 / 0.155 (b0762fa / 51e2295): what it lost beyond that is the wait for the rows. Each half
slot's last reader is at the end of a pair or its middle, so the next pair's S waits for a half that can only be
gathered at the pair's end: a gather's latency is exposed once a pair, where this schedule gathers a block ahead. With
two slots (all that shared memory holds) no order of the producer's waits hides it: publishing the halves freed at a
pair's end one by one, each once landed, gave 0.189 (and 0.201 in the other order); FlashMLA's copies that arrive on
their barrier themselves (`cp.async.mbarrier.arrive.noinc`, which Pallas cannot emit on its barriers) would spare the
producer its remaining waits, not the compute warpgroups theirs for the rows.

Variants of this (the owner) schedule measured and removed (one run each, H100, B = 128, `bash bench/lab/h200_runs.sh
mla_seesaw` at 03bb1d8 against 0.171 ms for it; the code is in 03bb1d8): the slot in 2 or 4 parts, each gathered,
published and freed on its own so that S starts on a block's first part (0.175 / 0.172 ms); warpgroup 0 issuing the next
block's S right behind its P V (0.179; with 2 parts 0.172). The rows copied but never waited for take as long as the
whole kernel (0.172), where the compute alone takes 0.145 and the gathers alone 0.137: what the kernel loses to its
gathers is their traffic beside the tensor cores' reads, not their latency, so reordering the waits cannot win it back.
The one setting ahead is warpgroup 0 on 192 of the value columns (`OWNER_COLUMNS`, 240 / 224 registers), in three runs
on H100s: 0.168 / 0.168 / 0.162 ms against 0.171 / 0.172 / 0.168; not yet timed on the H200, whose figures the default
keeps until it is.

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
OWNER_COLUMNS = 256  # value columns warpgroup 0 (the softmax owner) accumulates, the first ones; warpgroup 1 the rest
OWNER_REGISTERS, SECOND_REGISTERS, PRODUCER_REGISTERS = 256, 200, 40  # a thread's, set_max_registers
WGMMA_MAX_N = 256
GATHER_L2_HINTS = False  # the gather's copies with L2 prefetch and evict-last hints (`_copy_with_l2_hints`)
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


def _gather_block(table_ref, indices_ref, first, keys, rows_ref, index_ref):
    """Emitted by the producer warpgroup (inside `plgpu.inline_mgpu`): cp.async copies of the 64 rows
    table_ref[indices_ref[first + i]] into rows_ref ([64, 576] in 8 x 64 tiles, 128-byte swizzle), zeros for a −1
    index, and of the 64 indices into index_ref. `keys`: this thread's rows' indices (`_load_thread_keys`, loaded
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
        for tile in range(tiles_per_row):
            copy = _copy_with_l2_hints if GATHER_L2_HINTS else _copy
            copy(mu.getelementptr(target, [tile * 1024], ir.IntegerType.get_signless(8)),
                 mu.getelementptr(source, [tile * TILE_COLUMNS], ir.BF16Type.get()), size, policy)

    for row, key in zip(rows_of_thread, keys):
        copy_row(row, key)

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

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref):
        """Starts copying rows cache[indices[start:start + 64]] (zeros for −1) into rows_ref, and those indices
        into index_ref; `keys` are `load_keys(indices_gmem, start)`. `wait_for_gathers` completes them."""
        plgpu = self.plgpu

        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                      plgpu.Layout.WG_STRIDED((KEYS_HELD,), PASSES), plgpu.RefType(self.tiles),
                                      plgpu.RefType()))
        def _gather(ctx, table_ref, indices_ref, first, keys, rows, indices_slot):
            del ctx
            _gather_block(table_ref, indices_ref, first.registers.item(), keys, rows, indices_slot)

        _gather(cache_gmem, indices_gmem, start, keys, rows_ref, index_ref)

    def wait_for_gathers(self, pending: int):
        """Waits until at most `pending` of this thread's gathers are in flight."""
        self.plgpu.inline_mgpu()(lambda ctx: _wait_for_gathers(pending))()


class _Interpreted(InterpretedOps):
    """The kernel's operations in Mosaic GPU's interpreter (CPU), which has no rule for inline Mosaic GPU code: the
    gather copies row by row, of the keys loaded ahead (a [64] array). The interpreter checks the rest of the kernel
    as the GPU runs it: the warpgroups, their barriers (every phase observed by each waiter), the slots, the indexing
    and the softmax."""

    def load_keys(self, indices_gmem, start):
        return indices_gmem[pl.ds(start, BLOCK_KEYS)]

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref):
        index_ref[...] = indices_gmem[pl.ds(start, BLOCK_KEYS)]

        @pl.loop(0, BLOCK_KEYS)
        def _row(i):
            key = keys[i]
            row = cache_gmem[jnp.maximum(key, 0)]
            rows_ref[i] = jnp.where(key >= 0, row, jnp.zeros_like(row))

    def wait_for_gathers(self, pending: int):
        del pending  # the copies above are done when they return


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
    split_len = pl.cdiv(pl.cdiv(topk, splits), BLOCK_KEYS) * BLOCK_KEYS
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
                           scale_log2=scale_log2, cache_gmem=cache_gmem, indices_gmem=indices_gmem,
                           q_gmem=q_gmem, out_gmem=out_gmem, lse_gmem=lse_gmem)
        _owner_schedule(program, *scratch)

    def entry(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem=None):
        pl.run_scoped(
            lambda *scratch: kernel(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem, scratch),
            *_owner_scratch(plgpu, tiles),
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
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **interpret_option(interpret))
    outs = call(listed, q, flat_cache, indices.reshape(-1))
    if not split_out:
        return outs[0][:, 0]
    from .sparse_mla_attention import _combine_splits  # here: that module imports this one

    return _combine_splits(outs[0], outs[1], q.dtype)


class _Program:
    """What the warpgroups share in a program (a query's head block and split of its list): where its query, rows
    and output are, and the scores' masking and the output's normalisation."""

    def __init__(self, ops, plgpu, *, t, split, heads, row_base, in_split, scale_log2, cache_gmem, indices_gmem,
                 q_gmem, out_gmem, lse_gmem):
        self.ops, self.plgpu = ops, plgpu
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

    def gather(self, block, keys, rows_ref, index_ref):
        self.ops.gather(self.cache_gmem, self.indices_gmem, self.row_base + block * BLOCK_KEYS, keys, rows_ref,
                        index_ref)

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
