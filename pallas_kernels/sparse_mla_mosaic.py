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
computes S ("seesaw"), which needs each warpgroup's softmax to wait for the other's row maxima; this first form
keeps one owner of the softmax state and relies on warpgroup 1's products filling the tensor cores while warpgroup 0
runs its softmax. At B = 128 on the H200 that leaves the tensor pipe busy 53% of the time, with DRAM at 31% of its
peak and L2 at 53% (Nsight Compute, `bash bench/lab/h200_runs.sh mla_ncu_mosaic`): the next step is more overlap
in warpgroup 0: the seesaw. The next block's S issued before this block's softmax would need a third row slot (with
two, that block's rows could only be gathered once the slot of the block before was free, just before they are
needed), and shared memory holds two: the query block 72 KiB and two row slots of 72 KiB (226 KiB with Pallas' own,
of the H200's 227: P has no buffer of its own for that reason).

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
    rows, index_slot = mu.memref_ptr(rows_ref), mu.memref_ptr(index_ref)
    [key_vector] = keys.registers.flat
    keys = [vector.extract(key_vector, [], [step]) for step in range(PASSES)]

    # In the wgmma layout (8-row tiles of 64 columns, 1 KiB each, row-major over [row / 8, column / 64]) row r's
    # chunk c of a tile sits at chunk c ^ (r % 8) (the 128-byte swizzle): the same for all of a thread's copies of a
    # row, which sit 1 KiB apart. A pass covers whole tiles, so the row's place in its tile is the same every pass.
    in_tile = arith.remui(rows_of_thread[0], mu.c(8, i32))
    chunk_offset = arith.addi(arith.muli(in_tile, mu.c(128, i32)),
                              arith.muli(arith.xori(lane, in_tile), mu.c(16, i32)))

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
            nvvm.cp_async_shared_global(mu.getelementptr(target, [tile * 1024], ir.IntegerType.get_signless(8)),
                                        mu.getelementptr(source, [tile * TILE_COLUMNS], ir.BF16Type.get()),
                                        16, nvvm.LoadCacheModifierKind.CG, cp_size=size)

    for row, key in zip(rows_of_thread, keys):
        copy_row(row, key)

    # The 64 indices (256 bytes): 16 threads, 16 bytes each.
    with mu.when(arith.cmpi(arith.CmpIPredicate.ult, thread, mu.c(BLOCK_KEYS * 4 // 16, i32))):
        source = mu.getelementptr(indices, [arith.extui(i64, arith.addi(first, arith.muli(thread, mu.c(4, i32))))],
                                  i32)
        target = mu.getelementptr(index_slot, [arith.muli(thread, mu.c(4, i32))], i32)
        nvvm.cp_async_shared_global(target, source, 16, nvvm.LoadCacheModifierKind.CG)
    nvvm.cp_async_commit_group()


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
        arg_types = (plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                     plgpu.Layout.WG_STRIDED((KEYS_HELD,), PASSES), plgpu.RefType(self.tiles), plgpu.RefType())

        @plgpu.inline_mgpu(arg_types=arg_types)
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
    listed = jnp.full((T,), topk, jnp.int32) if listed is None else jnp.minimum(listed.astype(jnp.int32), topk)
    scale_log2 = float(scale) * LOG2E  # scores in base 2: exp2 is one instruction
    tiles = (plgpu.TilingTransform((8, TILE_COLUMNS)), plgpu.SwizzleTransform(128))
    ops = _Interpreted() if interpret else _Compiled(tiles)

    def kernel(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem, scratch):
        q_smem, rows_smem, index_smem, alpha_smem, stats_smem, (rows_ready, rows_free, p_ready, q_ready, done) = scratch
        head_block, split, t = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("t")
        wg = lax.axis_index("wg")
        heads = pl.ds(head_block * HEADS, HEADS)
        first = split * split_len
        in_split = jnp.clip(listed_gmem[t] - first, 0, split_len)
        blocks = (in_split + BLOCK_KEYS - 1) // BLOCK_KEYS

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            row_base = t * padded + first

            def publish(block):
                # Each thread's copies are complete (cp.async.wait_group); the fence orders them before the
                # warpgroup's arrival for the tensor cores' reads (the async proxy).
                plgpu.commit_smem()
                plgpu.barrier_arrive(rows_ready.at[block % SLOTS])

            def gather(block, keys):
                ops.gather(cache_gmem, indices_gmem, row_base + block * BLOCK_KEYS, keys, rows_smem.at[block % SLOTS],
                           index_smem.at[block % SLOTS])

            def keys_of(block):
                # A block's keys are loaded a block ahead of its gather, so that the gather's copies go out without
                # waiting for them (H200, B=128: 0.174 -> 0.170 ms; B=32 0.052 -> 0.050). Past the last block
                # (clamped) they are loaded and not used.
                block = jnp.clip(block, 0, jnp.maximum(blocks - 1, 0))
                return ops.load_keys(indices_gmem, row_base + block * BLOCK_KEYS)

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

        def rescale(array, factor):
            return array * lax.broadcast_in_dim(factor, array.shape, [0])

        def finish(acc, total, columns):
            """Normalise this warpgroup's output columns and store them (and, split, the log-sum-exp)."""
            some = total > 0
            out = rescale(acc, jnp.where(some, 1.0 / jnp.where(some, total, 1.0), 0.0))
            out_gmem[t, split, heads, columns] = out.astype(out_gmem.dtype)

        @pl.when(wg == 0)
        def _softmax_owner():
            # The softmax owner holds the most live values (its half of O, S, P, the wgmma descriptors): at 232
            # registers a thread it spilled 136 bytes, reloaded from local memory every block (L1 hit rate 16%
            # there, ncu); at 256, 28 (`tools/aot_h200.py`). 256 + 200 + the producer's 40 fit the 64K registers.
            plgpu.set_max_registers(OWNER_REGISTERS, action="increase")
            plgpu.copy_gmem_to_smem(q_gmem.at[t, heads], q_smem, q_ready)
            plgpu.barrier_wait(q_ready)
            m = ops.with_layout(jnp.full((HEADS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            total = ops.with_layout(jnp.zeros((HEADS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = ops.with_layout(jnp.zeros((HEADS, OWNER_COLUMNS), jnp.float32), plgpu.Layout.WGMMA)

            def block_step(block, carry):
                acc, m, total = carry
                slot = block % SLOTS
                plgpu.barrier_wait(rows_ready.at[slot])
                s = ops.matmul_transposed(q_smem, rows_smem.at[slot])
                # A key counts when it is listed (before `listed`) and not −1.
                key = ops.load(index_smem.at[slot], plgpu.Layout.WGMMA.reduce(0))
                position = ops.with_layout(lax.broadcasted_iota(jnp.int32, (BLOCK_KEYS,), 0),
                                           plgpu.Layout.WGMMA.reduce(0))
                counts = (key >= 0) & (position < in_split - block * BLOCK_KEYS)
                s = jnp.where(lax.broadcast_in_dim(counts, s.shape, [1]), s * scale_log2, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # every key so far none: exp2 stays finite
                alpha = jnp.exp2(m - m_safe)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                total = total * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.bfloat16)
                # P goes where the slot's rope columns were (read by S only, which is done): no buffer of its own,
                # and the slot is refilled only once both warpgroups are done with it.
                rows_smem[slot, :, pl.ds(LATENT, BLOCK_KEYS)] = p16
                alpha_smem[slot] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[slot])
                acc = ops.accumulate(rescale(acc, alpha), p16, rows_smem.at[slot, :, pl.ds(0, OWNER_COLUMNS)])
                plgpu.barrier_arrive(rows_free.at[slot])
                return acc, m_new, total

            acc, m, total = lax.fori_loop(0, blocks, block_step, (acc, m, total))
            stats_smem[0] = total
            plgpu.commit_smem()
            plgpu.barrier_arrive(done)
            finish(acc, total, pl.ds(0, OWNER_COLUMNS))
            if lse_gmem is not None:
                some = total > 0
                lse = jnp.where(some, (m + jnp.log2(jnp.where(some, total, 1.0))) / LOG2E, -jnp.inf)
                lse_gmem[t, split, heads] = lse

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
                alpha = ops.load(alpha_smem.at[slot], plgpu.Layout.WGMMA.reduce(1))
                p16 = rows_smem.at[slot, :, pl.ds(LATENT, BLOCK_KEYS)]
                accs = tuple(ops.accumulate(rescale(acc, alpha), p16, rows_smem.at[slot, :, pl.ds(start, width)])
                             for acc, (start, width) in zip(accs, pieces))
                plgpu.barrier_arrive(rows_free.at[slot])
                return accs

            accs = lax.fori_loop(0, blocks, block_step, accs)
            plgpu.barrier_wait(done)
            total = ops.load(stats_smem.at[0], plgpu.Layout.WGMMA.reduce(1))
            for acc, (start, width) in zip(accs, pieces):
                finish(acc, total, pl.ds(start, width))

    def entry(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem=None):
        pl.run_scoped(
            lambda *scratch: kernel(listed_gmem, q_gmem, cache_gmem, indices_gmem, out_gmem, lse_gmem, scratch),
            plgpu.SMEM((HEADS, WIDTH), jnp.bfloat16, transforms=tiles),
            plgpu.SMEM((SLOTS, BLOCK_KEYS, WIDTH), jnp.bfloat16, transforms=tiles),
            plgpu.SMEM((SLOTS, BLOCK_KEYS), jnp.int32),
            plgpu.SMEM((SLOTS, HEADS), jnp.float32),
            plgpu.SMEM((1, HEADS), jnp.float32),
            (plgpu.Barrier(num_barriers=SLOTS),  # rows_ready: the producer's arrival
             plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),  # rows_free: both compute warpgroups
             plgpu.Barrier(num_barriers=SLOTS),  # p_ready: warpgroup 0's P and rescale of the slot's block
             plgpu.Barrier(),  # q_ready (TMA)
             plgpu.Barrier()),  # done: warpgroup 0's row sums are in stats_smem
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
        num_threads=3, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
        **interpret_option(interpret))
    outs = call(listed, q, flat_cache, indices.reshape(-1))
    if not split_out:
        return outs[0][:, 0]
    from .sparse_mla_attention import _combine_splits  # here: that module imports this one

    return _combine_splits(outs[0], outs[1], q.dtype)
