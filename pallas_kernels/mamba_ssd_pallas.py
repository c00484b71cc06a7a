"""Pallas (Triton) kernel of the packed variable-length Mamba2 SSD scan; semantics in `mamba_ssd`'s docstring.

One fused kernel, one program per (head, head-dim block, span of tokens). The program walks its span in blocks of
`block_t` tokens and carries the [P, N] state in registers from block to block, so chunk states never go through
memory (the unfused mamba_ssm scan writes and re-reads them between five kernels). The per-block math is in
`_ssd_blocks`. The block length only changes rounding, not the function (the decomposition is exact for any block
length), so the kernel's `block_t` is a tile size chosen for the GPU and may differ from the model's `chunk_size`;
blocks are still aligned to sequence starts and never mix sequences.

Spans: by default a span is a whole sequence, which starts from its initial state and ends by writing its final
state. That leaves a single long sequence with only H x tiles programs, so when the sequences are too few to fill
the GPU the scan is segmented (`mamba_ssd_segments`): sequences are cut into segments of `segment_len` tokens, two
small kernels find the state at every segment boundary, and this kernel runs one program per segment, starting
from the state at the segment's start. The choice is static (token count and sequence-row count of
the call, `_default_segment_len`), and the segmented scan computes the same function for any packing.

The same kernel serves the pooled variant (`pooled=True`): there sequence s reads its initial state from
`pool[slot_ids[s]]` (only when `has_initial_state[s]`; a fresh sequence's load is fully masked, so its slot's old
contents are never read) and stores its final state back there, in the same buffer (input_output_aliases: the
donated pool is updated in place). Programs of empty sequences (padding rows on the null slot) neither load nor
store state, so only the slots of real sequences are touched.

Triton needs power-of-two tiles: head dim P and state size N are padded up to powers of two by masked loads and
stores inside the kernel (no copies in the wrapper). A head dim that is not a power of two ends in a narrow tile, so
P = 80 runs as a 64-wide and a 16-wide tile (or as one tile padded to 128).
Products run on bf16 operands when the inputs are bf16 (float32 accumulation, float32 state) and in full float32
(IEEE, not TF32) when the inputs are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dispatch import dot_precision, largest_pow2_divisor, next_pow2
from pallas_kernels._mamba_tiles import head_dim_tiles, tile_masks
from pallas_kernels._ssd_blocks import StepRule, block_decay, block_output, load_block, scan_blocks, state_input
from pallas_kernels.mamba_ssd_segments import FIRST, LAST, LENGTH, SEQ, START, segment_start_states, segment_table
from pallas_kernels.packing import for_each_padding_block

_f32 = jnp.float32


def _ssd_kernel(cu_ref, *refs, num_seqs, num_tokens, H, P, N, R, BT, BP, BP_last, BN, npb, has_init, pooled, segmented,
                rule, prefetch, write_states=True):
    if segmented:
        tab_ref, starts_ref, *refs = refs
    x_ref, dt_ref, a_ref, d_ref, dtb_ref, b_ref, c_ref, *rest = refs
    if pooled:
        slot_ref, init_flag_ref, _, y_ref, pool_ref = rest  # the pool input is aliased to pool_ref
    elif has_init:
        init_ref, y_ref, fin_ref = rest
    else:
        y_ref, fin_ref = rest
    # Tile-major: the programs of every head's first tile come first (`_mamba_tiles.head_dim_tiles`: with a narrow
    # last tile, the GPU then pairs a wide program with a narrow one on an SM rather than two wide ones).
    j, h = pl.program_id(0) // H, pl.program_id(0) % H
    g = h // R
    k = pl.program_id(1)
    if segmented:
        seq, t0, length = tab_ref[SEQ, k], tab_ref[START, k], tab_ref[LENGTH, k]
        last = tab_ref[LAST, k] != 0
        only = (tab_ref[FIRST, k] != 0) & last  # the sequence's only segment
        num_spans = tab_ref.shape[1]
    else:
        seq, t0 = k, cu_ref[k]
        length = cu_ref[k + 1] - t0
        only = last = True
        num_spans = num_seqs
    a = a_ref[h].astype(_f32)
    dval = d_ref[h].astype(_f32)
    dtb = dtb_ref[h].astype(_f32)
    rows = lax.broadcasted_iota(jnp.int32, (BT,), 0)

    def scan_tile(p0, BP):
        """The program's work on head-dim rows p0 .. p0 + BP - 1 (those < P)."""
        pmask, nmask, pn_mask = tile_masks(p0, BP=BP, BN=BN, P=P, N=N)

        def state_tile(ref, row):
            return ref.at[row, h, pl.ds(p0, BP), pl.ds(0, BN)]

        def load_start():
            # The initial state is read here only by a sequence's only span, whose program also writes its final
            # state: the segments of a longer sequence start from the states of the state passing
            # (`mamba_ssd_segments`).
            if pooled:
                mask = pn_mask & only & (init_flag_ref[seq] != 0)
                st = plgpu.load(state_tile(pool_ref, slot_ref[seq]), mask=mask, other=0.0).astype(_f32)
            elif has_init:
                st = plgpu.load(state_tile(init_ref, seq), mask=pn_mask & only, other=0.0).astype(_f32)
            else:
                st = jnp.zeros((BP, BN), _f32)
            if segmented:
                passed = plgpu.load(state_tile(starts_ref, k), mask=pn_mask & ~only, other=0.0)
                st = jnp.where(only, st, passed)
            return st

        def store_final(st):
            mask = pn_mask & last
            if pooled and not write_states:
                return  # the pool is only read (speculative verify: mamba_ssd.ssd_chunk_scan_pooled's write_states)
            if pooled:
                plgpu.store(state_tile(pool_ref, slot_ref[seq]), st.astype(pool_ref.dtype), mask=mask)
            else:
                plgpu.store(state_tile(fin_ref, seq), st, mask=mask)

        def load(i):
            return load_block(x_ref, dt_ref, b_ref, c_ref, t0=t0 + i * BT, n_valid=length - i * BT, h=h, g=g, p0=p0,
                              pmask=pmask, nmask=nmask, BT=BT, BP=BP, BN=BN)

        def block(i, tiles, st):
            x, dt_raw, bm, cm = tiles
            n_valid = length - i * BT
            dt, cum, cum_last = block_decay(dt_raw, n_valid, a, dtb, rule)
            y = block_output(x, bm, cm, dt, cum, st, dval, rule)
            plgpu.store(y_ref.at[pl.ds(t0 + i * BT, BT), h, pl.ds(p0, BP)], y.astype(y_ref.dtype),
                        mask=(rows < n_valid)[:, None] & pmask[None, :])
            return st * jnp.exp(cum_last) + state_input(x, bm, dt, cum, cum_last, rule)

        def scan_span():
            store_final(scan_blocks((length + (BT - 1)) // BT, load, block, load_start(), prefetch=prefetch))

        if pooled or segmented:
            # Pooled: empty sequences are padding rows, several of them on the null slot, and must not touch the
            # pool. Segmented: table rows past the used segments. (Empty sequences own no segment; see
            # `_ssd_pallas`.)
            pl.when(length > 0)(scan_span)
        else:
            scan_span()  # an empty sequence's final state is its initial state: it is still written

        # Tokens past cu[-1] (bucket padding) belong to no sequence; the last span's programs zero them.
        @pl.when(k == num_spans - 1)
        def _zero_tail():
            zeros = jnp.zeros((BT, BP), y_ref.dtype)

            def zero_block(u0):
                mask = (rows < (num_tokens - u0))[:, None] & pmask[None, :]
                plgpu.store(y_ref.at[pl.ds(u0, BT), h, pl.ds(p0, BP)], zeros, mask=mask)

            for_each_padding_block(cu_ref, num_tokens, BT, zero_block)

    if BP_last == BP:
        scan_tile(j * BP, BP)
    else:  # two bodies, one per tile width (static shapes): the last tile is the narrow one
        pl.when(j < npb - 1)(lambda: scan_tile(j * BP, BP))
        # p0 stays traced (j is npb - 1 here): a static start would have JAX reject the masked tile's overhang
        pl.when(j == npb - 1)(lambda: scan_tile(j * BP, BP_last))


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "block_t", "block_p", "segment_len",
                                             "state_block_t", "prefetch", "narrow_last_tile", "num_warps",
                                             "num_stages", "interpret", "write_states"))
def _ssd_pallas(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, pool_index, *, dt_softplus, dt_limit, block_t,
                block_p, segment_len, state_block_t, prefetch, narrow_last_tile, num_warps, num_stages, interpret,
                write_states=True):
    """Without `pool_index`, `states` is None or the initial states [S, H, P, N] and the final states come back as a
    new float32 array. With `pool_index` = (slot_ids, has_initial_state), both int32[S], `states` is the slot pool
    and comes back updated in place. `segment_len` 0: one span per sequence; else segments of that many tokens."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    S = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    # Triton's dot needs every tile dim >= 16; the masks make the extra rows and columns inert.
    BP, npb, BP_last = head_dim_tiles(P, block_p, narrow_last=narrow_last_tile)
    BN = max(next_pow2(N), 16)
    compute_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else _f32
    rule = StepRule(dt_softplus=dt_softplus, dt_limit=dt_limit, compute_dtype=compute_dtype,
                    precision=dot_precision(compute_dtype))
    pooled = pool_index is not None
    segmented = segment_len > 0
    args, num_spans = [cu], S
    if segmented:
        table, num_used = segment_table(cu, T, segment_len)
        starts = segment_start_states(x, dt, A, B, dt_bias, table, num_used, states, pool_index,
                                      segment_len=segment_len, block_t=state_block_t, block_p=block_p, rule=rule,
                                      num_warps=num_warps, num_stages=num_stages, prefetch=prefetch,
                                      interpret=interpret)
        args, num_spans = [cu, table, starts], table.shape[1]
    kernel = functools.partial(
        _ssd_kernel, num_seqs=S, num_tokens=T, H=H, P=P, N=N, R=H // G, BT=block_t, BP=BP, BP_last=BP_last, BN=BN,
        npb=npb, has_init=states is not None, pooled=pooled, segmented=segmented, rule=rule, prefetch=prefetch,
        write_states=write_states)
    args += [x, dt, A, D, dt_bias, B, C]
    final_shape, aliases = jax.ShapeDtypeStruct((S, H, P, N), _f32), {}
    if pooled:
        args += [*pool_index, states]
        final_shape, aliases = jax.ShapeDtypeStruct(states.shape, states.dtype), {len(args) - 1: 1}
    elif states is not None:
        args.append(states.astype(_f32))
    y, final = pl.pallas_call(
        kernel,
        grid=(H * npb, num_spans),
        out_shape=(jax.ShapeDtypeStruct((T, H, P), x.dtype), final_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ssd_chunk_scan_pooled" if pooled else "ssd_chunk_scan",
    )(*args)
    if segmented and not pooled:
        # An empty sequence owns no segment, so no program wrote its final state: that is its initial state.
        empty = (cu[1:] == cu[:-1])[:, None, None, None]
        final = jnp.where(empty, 0.0 if states is None else states.astype(_f32), final)
    return y, final


# When to segment. Measured on the H200 (132 SMs), T = 8192, one sequence, one span per sequence: Nano-30B's 128
# programs of 32-wide head-dim tiles ran at a third of the rate that 16 sequences (1024 programs) reach (678 vs
# 227 µs), while Nano-9B's 256 programs of 64-wide tiles came within 16% of theirs (822 vs 708 µs). So the scan is
# segmented below one program per SM, into about _SEGMENT_PROGRAMS programs, with segments no shorter than
# _MIN_SEGMENT (each one costs a state round trip through memory) and no longer than _MAX_SEGMENT.
_SEGMENT_BELOW_PROGRAMS = 132
_SEGMENT_PROGRAMS = 1024
_MIN_SEGMENT, _MAX_SEGMENT = 256, 4096


def _default_block_p(H: int, P: int, S: int, min_programs: int = 256) -> int:
    """Widest head-dim tile, at most P (a P that is not a power of two ends in a narrow tile:
    `_mamba_tiles.head_dim_tiles`), that still gives about two programs per SM of an H200 (132 SMs).

    Measured on the H200 (bench/mamba_kernels.py --tune, T = 8192): with few sequences the kernel is starved of
    programs and narrower tiles win (Nano-30B S=1: 32 wide 1.01 ms vs 64 wide 1.26 ms). Nano-9B's P = 80 runs as
    64 + 16 at every sequence count: fewer products than one tile padded to 128 and twice the programs (2026-12-02:
    S=1 695 vs 1032 us, S=16 677 vs 685, one real row of 256 as the engine packs a prompt 1007 vs 1395; at T = 2048
    195 vs 204 and 509 vs 500). Tiles narrower than 32 were slower.
    """
    bp = max(1 << (P.bit_length() - 1), 16)
    while bp > 32 and H * (-(-P // bp)) * S < min_programs:
        bp //= 2
    return bp


def _segmented_block_p(P: int) -> int:
    """Segments supply the programs, so the widest head-dim tile (C Bᵀ once per head), capped at 128 columns."""
    return min(next_pow2(P), 128)


def segment_len_for(T: int, H: int, P: int, block_t: int) -> int:
    """The longest power-of-two segment within [_MIN_SEGMENT, _MAX_SEGMENT] that still gives about
    _SEGMENT_PROGRAMS programs over T tokens, or 0 when T holds fewer than two such segments."""
    programs_per_segment = H * -(-P // _segmented_block_p(P))
    L = _MAX_SEGMENT
    while L > _MIN_SEGMENT and programs_per_segment * (T // L) < _SEGMENT_PROGRAMS:
        L //= 2
    L = max(L, block_t)
    return L if T // L >= 2 else 0


def _default_segment_len(T: int, S: int, H: int, P: int, block_t: int) -> int:
    """0 (one span per sequence) when the S sequence rows give the GPU enough programs, else `segment_len_for`."""
    if H * -(-P // _default_block_p(H, P, S)) * S >= _SEGMENT_BELOW_PROGRAMS:
        return 0
    return segment_len_for(T, H, P, block_t)


def _check_block(name: str, size: int) -> None:
    if size < 16 or size & (size - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {size}")


def _launch(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, states, pool_index, dt_softplus, dt_limit,
            interpret, block_t, block_p, segment_len, state_block_t, prefetch, narrow_last_tile, num_warps,
            num_stages, write_states=True):
    """Tile defaults of both entry points: `block_t` is chunk_size rounded to a power of two, clipped to [16, 32]
    (H200, T = 8192: 32-token blocks 0.83 / 0.71 ms for Nano-9B S=1 / S=16 against 1.34 / 0.96 ms with 64);
    `segment_len` (0: one span per sequence) defaults to `_default_segment_len`; `block_p` (the head-dim tile) to
    `_segmented_block_p` when segmented, else `_default_block_p`; `state_block_t`, the block length of the segment
    state kernel (no [BT, BT] products there, so longer blocks cost little), to 64 or the largest power of two that
    divides the segment length. `prefetch` (the next block's loads issued before this block's arithmetic) is on by
    default: on the H200 at T = 8192 it took Nano-9B's one sequence from 823 to 805 µs (one span), its 16
    sequences from 723 to 716, Nano-30B's one sequence (segmented) from 318 to 285 and its 16 from 228 to 195
    (`bash bench/lab/h200_runs.sh scan_tune`, 2026-12-01). `narrow_last_tile` (on by default): see
    `_mamba_tiles.head_dim_tiles`; it took Nano-9B's one sequence from 770 to 692 µs at 8k and from 3,151 to 2,818
    at 32k (2026-12-02)."""
    T, H, P = x.shape
    S = cu_seqlens.shape[0] - 1
    if block_t is None:
        block_t = max(16, min(next_pow2(chunk_size), 32))
    if segment_len is None:
        segment_len = _default_segment_len(T, S, H, P, block_t) if write_states else 0
    if block_p is None:
        block_p = _segmented_block_p(P) if segment_len else _default_block_p(H, P, S)
    _check_block("block_t", block_t)
    if segment_len % block_t:
        raise ValueError(f"segment_len must be 0 or a multiple of block_t ({block_t}), got {segment_len}")
    if state_block_t is None:
        state_block_t = largest_pow2_divisor(segment_len, 64) if segment_len else block_t
    _check_block("state_block_t", state_block_t)
    if segment_len % state_block_t:
        raise ValueError(f"segment_len must be a multiple of state_block_t ({state_block_t}), got {segment_len}")
    D = jnp.zeros((H,), _f32) if D is None else D
    dt_bias = jnp.zeros((H,), _f32) if dt_bias is None else dt_bias
    return _ssd_pallas(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, pool_index, dt_softplus=dt_softplus,
                       dt_limit=dt_limit, block_t=block_t, block_p=block_p, segment_len=segment_len,
                       state_block_t=state_block_t, prefetch=prefetch, narrow_last_tile=narrow_last_tile,
                       num_warps=num_warps, num_stages=num_stages, interpret=interpret, write_states=write_states)


def ssd_chunk_scan_pallas(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, initial_states=None,
                          dt_softplus=True, dt_limit=None, interpret=False, block_t=None, block_p=None,
                          segment_len=None, state_block_t=None, prefetch=True, narrow_last_tile=True, num_warps=4,
                          num_stages=2):
    """Kernel entry point of `mamba_ssd.ssd_chunk_scan`; tile options as in `_launch`."""
    return _launch(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   states=initial_states, pool_index=None, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   interpret=interpret, block_t=block_t, block_p=block_p, segment_len=segment_len,
                   state_block_t=state_block_t, prefetch=prefetch, narrow_last_tile=narrow_last_tile,
                   num_warps=num_warps, num_stages=num_stages)


def ssd_chunk_scan_pooled_pallas(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, state_pool, slot_ids,
                                 has_initial_state, dt_softplus=True, dt_limit=None, interpret=False, block_t=None,
                                 block_p=None, segment_len=None, state_block_t=None, prefetch=True,
                                 narrow_last_tile=True, num_warps=4, num_stages=2, write_states=True):
    """Kernel entry point of `mamba_ssd.ssd_chunk_scan_pooled`: -> (y, state_pool updated in place, or untouched
    without `write_states`)."""
    pool_index = (slot_ids.astype(jnp.int32), has_initial_state.astype(jnp.int32))
    return _launch(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   states=state_pool, pool_index=pool_index, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   interpret=interpret, block_t=block_t, block_p=block_p, segment_len=segment_len,
                   state_block_t=state_block_t, prefetch=prefetch, narrow_last_tile=narrow_last_tile,
                   num_warps=num_warps, num_stages=num_stages, write_states=write_states)
