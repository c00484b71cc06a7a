"""The first two phases of the segmented SSD scan: the state each segment of a long sequence hands to the next.

The fused scan (`mamba_ssd_pallas`) runs one program per (head, head-dim tile, span of tokens) and walks its span
serially. With one span per sequence, a single long sequence has only H x tiles programs (Nano-30B: 64 heads x 2
tiles of 32) for the H200's 132 SMs. The segmented scan cuts each sequence into segments of L tokens, aligned to the sequence start
(`packing.aligned_blocks`: a segment never mixes sequences; a sequence's last segment may be short), and runs the
fused kernel over segments instead, in three phases:

  (a) `_segment_state_kernel`, one program per (head, head-dim tile, segment), for every segment but the last of
      its sequence (those are always L tokens long): the segment's state from a zero start,
      local[k] = sum_t exp(cum_end - cum_t) dt_t x_t ⊗ B_t, and its decay exp(sum_t dt_t A) over the whole segment.
      No outputs, so no C, no C Bᵀ and no [BT, BT] scores: one product per block, and blocks can be long.
      local[k] goes to row k + 1 of the segment-state buffer.
  (b) `_state_passing_kernel`, one program per (head, run of state elements), walks the segments in order:
      start[k] = the sequence's initial state (the pool slot's, in the pooled variant) when k opens its sequence,
      else decay[k - 1] * start[k - 1] + local[k - 1], and writes start[k] over row k (whose local[k - 1] it has
      just read), for every segment of a sequence of more than one.
  (c) the fused kernel over segments (`mamba_ssd_pallas`): segment k starts from row k, or, when it is its
      sequence's only segment, from the initial state; it writes y for its tokens, and a sequence's last segment
      writes the final state. So a program reads the pool only where it also writes it: the first segment of a
      longer sequence never reads a slot that the same launch's last segment is writing.

Phase (c) recomputes each segment's state recurrence from its true start state, rather than phase (a) also writing
y from the zero start and phase (c) adding the missing exp(cum) ∘ (C startᵀ): both do the same products in total
(the correction is the C stateᵀ product that (c) does anyway, and (a) then needs the intra-block terms), but the
correction would round y twice in bf16 (or keep a float32 y) and send y through memory twice.

Memory: the float32 segment states go through memory four times (written by (a), read and written by (b), read by
(c)): at Nano-9B's shape 4 x 5.2 MB per segment, as much as the 21 MB of bf16 x that 1024 tokens read. So segments
are long (hundreds to thousands of tokens, where mamba_ssm writes states per 128-token chunk), and only as many as
the GPU needs to fill its SMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dispatch import next_pow2
from pallas_kernels._mamba_tiles import head_dim_tiles, head_tile
from pallas_kernels._ssd_blocks import StepRule, block_decay, load_block, scan_blocks, state_input
from pallas_kernels.packing import aligned_blocks

_f32 = jnp.float32

# Rows of the segment table (int32[5, NSEG]).
SEQ, START, LENGTH, FIRST, LAST = range(5)


def segment_table(cu_seqlens, num_tokens: int, segment_len: int):
    """(table int32[5, NSEG], num_used int32[1]): segment k of the packing is tokens table[START, k] ..
    + table[LENGTH, k] - 1 of sequence table[SEQ, k], and table[FIRST / LAST, k] (0 or 1) say whether it opens /
    closes that sequence. Segments k >= num_used are unused (length 0, neither first nor last); empty sequences own
    no segment. NSEG = packing.num_blocks_bound(T, S, L), static."""
    tab = aligned_blocks(cu_seqlens, num_tokens, segment_len)
    table = jnp.stack([tab[name].astype(jnp.int32) for name in ("seq", "start", "length", "first", "last")])
    return table, (tab["block_begin"][-1] + tab["nblocks"][-1]).reshape(1).astype(jnp.int32)


def _segment_state_kernel(tab_ref, x_ref, dt_ref, a_ref, dtb_ref, b_ref, buf_ref, decay_ref, *, P, N, R, L, BT, BP,
                          BN, npb, rule, prefetch):
    pid = pl.program_id(0)  # outside the `when` bodies: interpret mode substitutes program ids at the top level only
    h, g, p0, pmask, nmask, pn_mask = head_tile(pid, npb=npb, BP=BP, BN=BN, P=P, N=N, R=R)
    k = pl.program_id(1)
    t0 = tab_ref[START, k]
    a = a_ref[h].astype(_f32)
    dtb = dtb_ref[h].astype(_f32)

    # A sequence's last segment hands nothing on (and is the only one that can be short): every segment run here is
    # exactly L tokens, so the block count is static, and a segment follows it (row k + 1 exists).
    @pl.when((tab_ref[LENGTH, k] > 0) & (tab_ref[LAST, k] == 0))
    def _local_state():
        def load(i):
            return load_block(x_ref, dt_ref, b_ref, None, t0=t0 + i * BT, n_valid=L - i * BT, h=h, g=g, p0=p0,
                              pmask=pmask, nmask=nmask, BT=BT, BP=BP, BN=BN)

        def step(i, tiles, carry):
            st, log_decay = carry
            x, dt_raw, bm, _ = tiles
            dt, cum, cum_last = block_decay(dt_raw, BT, a, dtb, rule)
            return st * jnp.exp(cum_last) + state_input(x, bm, dt, cum, cum_last, rule), log_decay + cum_last

        st, log_decay = scan_blocks(L // BT, load, step, (jnp.zeros((BP, BN), _f32), jnp.zeros((), _f32)),
                                    prefetch=prefetch)
        plgpu.store(buf_ref.at[k + 1, h, pl.ds(p0, BP), pl.ds(0, BN)], st, mask=pn_mask)

        @pl.when(pid % npb == 0)  # every head-dim tile of the head has the same decay
        def _decay():
            decay_ref[k, h] = jnp.exp(log_decay)


def _state_passing_kernel(tab_ref, num_used_ref, decay_ref, *rest, num_segments, PN, BE, has_init, pooled):
    if pooled:
        slot_ref, init_flag_ref, init_ref, _, buf_ref = rest  # the local states' input is aliased to buf_ref
    elif has_init:
        init_ref, _, buf_ref = rest
    else:
        _, buf_ref = rest
    h = pl.program_id(0)
    e0 = pl.program_id(1) * BE
    cols = pl.ds(e0, BE)
    emask = e0 + lax.broadcasted_iota(jnp.int32, (BE,), 0) < PN

    def load(k):
        # Everything segment k needs but the carry, so that `scan_blocks` can issue it one segment early.
        live = k < num_used_ref[0]
        kk = jnp.minimum(k, num_segments - 1)
        first = live & (tab_ref[FIRST, kk] != 0)
        hands_on = live & (tab_ref[LAST, kk] == 0)
        in_longer = hands_on | (live & ~first)  # k belongs to a sequence of more than one segment
        seq = tab_ref[SEQ, kk]
        init_mask = emask & first & hands_on
        if pooled:
            init = plgpu.load(init_ref.at[slot_ref[seq], h, cols], mask=init_mask & (init_flag_ref[seq] != 0),
                              other=0.0).astype(_f32)
        elif has_init:
            init = plgpu.load(init_ref.at[seq, h, cols], mask=init_mask, other=0.0)
        else:
            init = jnp.zeros((BE,), _f32)
        local = plgpu.load(buf_ref.at[jnp.minimum(kk + 1, num_segments - 1), h, cols], mask=emask & hands_on,
                           other=0.0)
        return first, hands_on, in_longer, init, local, decay_ref[kk, h]

    def step(k, tiles, carry):
        first, hands_on, in_longer, init, local, decay = tiles
        start = jnp.where(first, init, carry)
        plgpu.store(buf_ref.at[k, h, cols], start, mask=emask & in_longer)
        # decay was written only for segments that hand on; for the others the next segment opens a sequence and
        # drops the carry, and the where keeps whatever that load returned out of it.
        return start * jnp.where(hands_on, decay, 0.0) + local

    scan_blocks(num_used_ref[0], load, step, jnp.zeros((BE,), _f32), prefetch=True)


def segment_start_states(x, dt, A, B, dt_bias, table, num_used, states, pool_index, *, segment_len, block_t, block_p,
                       rule: StepRule, num_warps, num_stages, prefetch, interpret):
    """float32[NSEG, H, P, N]: row k is the state at the start of segment k, for every segment of a sequence of more
    than one segment (phases (a) and (b)); the other rows are unspecified. `states` / `pool_index` as in
    `mamba_ssd_pallas`."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    num_segments = table.shape[1]
    BP, npb, _ = head_dim_tiles(P, block_p, narrow_last=False)  # no output tiles here: equal tiles
    BN = max(next_pow2(N), 16)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    buf, decay = pl.pallas_call(
        functools.partial(_segment_state_kernel, P=P, N=N, R=H // G, L=segment_len, BT=block_t, BP=BP, BN=BN,
                          npb=npb, rule=rule, prefetch=prefetch),
        grid=(H * npb, num_segments),
        out_shape=(jax.ShapeDtypeStruct((num_segments, H, P, N), _f32),
                   jax.ShapeDtypeStruct((num_segments, H), _f32)),
        compiler_params=params,
        interpret=interpret,
        name="ssd_chunk_scan_segment_states",
    )(table, x, dt, A, dt_bias, B)

    PN = P * N
    BE = min(1024, next_pow2(PN))
    pooled = pool_index is not None
    args = [table, num_used, decay]
    if pooled:
        args += [*pool_index, states.reshape(states.shape[0], H, PN)]
    elif states is not None:
        args.append(states.astype(_f32).reshape(-1, H, PN))
    args.append(buf.reshape(num_segments, H, PN))
    starts = pl.pallas_call(
        functools.partial(_state_passing_kernel, num_segments=num_segments, PN=PN, BE=BE,
                          has_init=states is not None, pooled=pooled),
        grid=(H, pl.cdiv(PN, BE)),
        out_shape=jax.ShapeDtypeStruct((num_segments, H, PN), _f32),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ssd_chunk_scan_state_passing",
    )(*args)
    return starts.reshape(num_segments, H, P, N)
