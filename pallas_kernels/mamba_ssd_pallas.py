"""Pallas (Triton) kernel of the packed variable-length Mamba2 SSD scan; semantics in `mamba_ssd`'s docstring.

One fused kernel, one program per (head, head-dim block, sequence). The program walks its sequence in blocks of
`block_t` tokens aligned to the sequence start and carries the [P, N] state in registers from block to block, so
chunk states never go through memory (the unfused mamba_ssm scan writes and re-reads them between five kernels).
Per block, with cum = cumsum(dt * A) inside the block:

    y      = ((C Bᵀ) ∘ exp(cum_l - cum_s)[l >= s] ∘ dt_s) x  +  exp(cum) ∘ (C stateᵀ)  +  D x
    state <- exp(cum_last) state + xᵀ (B ∘ exp(cum_last - cum) dt)

The block length only changes rounding, not the function (the decomposition is exact for any block length), so the
kernel's `block_t` is a tile size chosen for the GPU and may differ from the model's `chunk_size`; blocks are still
aligned to sequence starts and never mix sequences.

The same kernel serves the pooled variant (`pooled=True`): there sequence s reads its initial state from
`pool[slot_ids[s]]` (only when `has_initial_state[s]`; a fresh sequence's load is fully masked, so its slot's old
contents are never read) and stores its final state back there, in the same buffer (input_output_aliases: the
donated pool is updated in place). Programs of empty sequences (padding rows on the null slot) neither load nor
store state, so only the slots of real sequences are touched.

Triton needs power-of-two tiles: head dim P and state size N are padded up to powers of two by masked loads and
stores inside the kernel (no copies in the wrapper), so P = 80 runs as a 128-wide (or two 64-wide) tile.
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
from pallas_kernels._dispatch import dot_precision, next_pow2
from pallas_kernels._mamba_tiles import head_tile, softplus
from pallas_kernels.packing import for_each_padding_block

_f32 = jnp.float32


def _dot(a, b, contract, precision):
    """2-D dot_general with float32 accumulation; `contract` = (lhs dim, rhs dim)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=_f32)


def _ssd_kernel(cu_ref, x_ref, dt_ref, a_ref, d_ref, dtb_ref, b_ref, c_ref, *rest, num_seqs, num_tokens, P, N,
                R, BT, BP, BN, npb, has_init, pooled, dt_softplus, dt_limit, compute_dtype, precision):
    if pooled:
        slot_ref, init_flag_ref, _, y_ref, pool_ref = rest  # the pool input is aliased to pool_ref
    elif has_init:
        init_ref, y_ref, fin_ref = rest
    else:
        y_ref, fin_ref = rest
    h, g, p0, pmask, nmask, pn_mask = head_tile(pl.program_id(0), npb=npb, BP=BP, BN=BN, P=P, N=N, R=R)
    s = pl.program_id(1)

    seq_start = cu_ref[s]
    seq_end = cu_ref[s + 1]
    nblocks = (seq_end - seq_start + (BT - 1)) // BT
    a = a_ref[h].astype(_f32)
    dval = d_ref[h].astype(_f32)
    dtb = dtb_ref[h].astype(_f32)

    rows = lax.broadcasted_iota(jnp.int32, (BT,), 0)
    causal = rows[:, None] >= rows[None, :]
    is_last_row = rows == BT - 1

    def state_tile(ref, row):
        return ref.at[row, h, pl.ds(p0, BP), pl.ds(0, BN)]

    def load_initial():
        if pooled:
            mask = pn_mask & (init_flag_ref[s] != 0)
            return plgpu.load(state_tile(pool_ref, slot_ref[s]), mask=mask, other=0.0).astype(_f32)
        if has_init:
            return plgpu.load(state_tile(init_ref, s), mask=pn_mask, other=0.0).astype(_f32)
        return jnp.zeros((BP, BN), _f32)

    def store_final(st):
        if pooled:
            plgpu.store(state_tile(pool_ref, slot_ref[s]), st.astype(pool_ref.dtype), mask=pn_mask)
        else:
            plgpu.store(state_tile(fin_ref, s), st, mask=pn_mask)

    def block(k, st):
        t0 = seq_start + k * BT
        rmask = rows < (seq_end - t0)
        xp_mask = rmask[:, None] & pmask[None, :]
        xn_mask = rmask[:, None] & nmask[None, :]
        x = plgpu.load(x_ref.at[pl.ds(t0, BT), h, pl.ds(p0, BP)], mask=xp_mask, other=0.0)
        dt = plgpu.load(dt_ref.at[pl.ds(t0, BT), h], mask=rmask, other=0.0).astype(_f32)
        bm = plgpu.load(b_ref.at[pl.ds(t0, BT), g, pl.ds(0, BN)], mask=xn_mask, other=0.0)
        cm = plgpu.load(c_ref.at[pl.ds(t0, BT), g, pl.ds(0, BN)], mask=xn_mask, other=0.0)

        dt = dt + dtb
        if dt_softplus:
            dt = softplus(dt)
        if dt_limit is not None:
            dt = jnp.clip(dt, dt_limit[0], dt_limit[1])
        # Rows past the sequence end get dt = 0: no decay, no input, so cum stays flat and cum[BT-1] is the value at
        # the last real token.
        dt = jnp.where(rmask, dt, 0.0)
        cum = lax.cumsum(dt * a, axis=0)
        cum_last = jnp.sum(jnp.where(is_last_row, cum, 0.0))

        bc = bm.astype(compute_dtype)
        cc = cm.astype(compute_dtype)
        xc = x.astype(compute_dtype)
        cb = _dot(cc, bc, (1, 1), precision)  # [BT, BT]
        decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
        scores = cb * decay * dt[None, :]
        y = _dot(scores.astype(compute_dtype), xc, (1, 0), precision)  # [BT, BP]
        y = y + _dot(cc, st.astype(compute_dtype), (1, 1), precision) * jnp.exp(cum)[:, None]
        y = y + dval * x.astype(_f32)
        plgpu.store(y_ref.at[pl.ds(t0, BT), h, pl.ds(p0, BP)], y.astype(y_ref.dtype), mask=xp_mask)

        wb = bm.astype(_f32) * (jnp.exp(cum_last - cum) * dt)[:, None]
        return st * jnp.exp(cum_last) + _dot(xc, wb.astype(compute_dtype), (0, 0), precision)  # [BP, BN]

    def scan_sequence():
        store_final(lax.fori_loop(0, nblocks, block, load_initial()))

    if pooled:
        # Empty sequences are padding rows, several of them on the null slot: they must not touch the pool.
        pl.when(nblocks > 0)(scan_sequence)
    else:
        scan_sequence()  # an empty sequence's final state is its initial state: it is still written

    # Tokens past cu[-1] (bucket padding) belong to no sequence; the last sequence's programs zero them.
    @pl.when(s == num_seqs - 1)
    def _zero_tail():
        zeros = jnp.zeros((BT, BP), y_ref.dtype)

        def zero_block(t0):
            mask = (rows < (num_tokens - t0))[:, None] & pmask[None, :]
            plgpu.store(y_ref.at[pl.ds(t0, BT), h, pl.ds(p0, BP)], zeros, mask=mask)

        for_each_padding_block(cu_ref, num_tokens, BT, zero_block)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "dt_limit", "block_t", "block_p", "num_warps",
                                             "num_stages", "interpret"))
def _ssd_pallas(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, pool_index, *, dt_softplus, dt_limit, block_t,
                block_p, num_warps, num_stages, interpret):
    """Without `pool_index`, `states` is None or the initial states [S, H, P, N] and the final states come back as a
    new float32 array. With `pool_index` = (slot_ids, has_initial_state), both int32[S], `states` is the slot pool
    and comes back updated in place."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    S = cu_seqlens.shape[0] - 1
    # Triton's dot needs every tile dim >= 16; the masks make the extra rows and columns inert.
    BP = max(min(next_pow2(P), block_p), 16)
    npb = -(-P // BP)
    BN = max(next_pow2(N), 16)
    BT = block_t
    compute_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else _f32
    precision = dot_precision(compute_dtype)
    pooled = pool_index is not None
    kernel = functools.partial(
        _ssd_kernel, num_seqs=S, num_tokens=T, P=P, N=N, R=H // G, BT=BT, BP=BP, BN=BN, npb=npb,
        has_init=states is not None, pooled=pooled, dt_softplus=dt_softplus, dt_limit=dt_limit,
        compute_dtype=compute_dtype, precision=precision)
    args = [cu_seqlens.astype(jnp.int32), x, dt, A, D, dt_bias, B, C]
    final_shape, aliases = jax.ShapeDtypeStruct((S, H, P, N), _f32), {}
    if pooled:
        args += [*pool_index, states]
        final_shape, aliases = jax.ShapeDtypeStruct(states.shape, states.dtype), {len(args) - 1: 1}
    elif states is not None:
        args.append(states.astype(_f32))
    return pl.pallas_call(
        kernel,
        grid=(H * npb, S),
        out_shape=(jax.ShapeDtypeStruct((T, H, P), x.dtype), final_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ssd_chunk_scan_pooled" if pooled else "ssd_chunk_scan",
    )(*args)


def _default_block_p(H: int, P: int, S: int, min_programs: int = 256) -> int:
    """Widest head-dim tile that still gives about two programs per SM of an H200 (132 SMs).

    Measured on the H200 (bench/mamba_kernels.py --tune, T = 8192): with few sequences the kernel is starved of
    programs and narrower tiles win (Nano-9B S=1: 64 wide 1.35 ms vs 128 wide 1.79 ms; Nano-30B S=1: 32 wide 1.01 ms
    vs 64 wide 1.26 ms); with 16 sequences the widest tile wins (Nano-9B S=16: 128 wide 0.96 ms vs 64 wide 1.21 ms),
    since it computes C Bᵀ once per head instead of once per tile. Tiles narrower than 32 were slower still.
    """
    bp = next_pow2(P)
    while bp > 32 and H * (-(-P // bp)) * S < min_programs:
        bp //= 2
    return bp


def _launch(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, states, pool_index, dt_softplus, dt_limit,
            interpret, block_t, block_p, num_warps, num_stages):
    """Tile defaults of both entry points: `block_t` is chunk_size rounded to a power of two, clipped to [16, 32]
    (H200, T = 8192: 32-token blocks 0.83 / 0.71 ms for Nano-9B S=1 / S=16 against 1.34 / 0.96 ms with 64); `block_p`
    (the head-dim tile) defaults to `_default_block_p`."""
    T, H, P = x.shape
    if block_p is None:
        block_p = _default_block_p(H, P, cu_seqlens.shape[0] - 1)
    if block_t is None:
        block_t = max(16, min(next_pow2(chunk_size), 32))
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    D = jnp.zeros((H,), _f32) if D is None else D
    dt_bias = jnp.zeros((H,), _f32) if dt_bias is None else dt_bias
    return _ssd_pallas(x, dt, A, B, C, D, dt_bias, cu_seqlens, states, pool_index, dt_softplus=dt_softplus,
                       dt_limit=dt_limit, block_t=block_t, block_p=block_p, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret)


def ssd_chunk_scan_pallas(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, initial_states=None,
                          dt_softplus=True, dt_limit=None, interpret=False, block_t=None, block_p=None, num_warps=4,
                          num_stages=2):
    """Kernel entry point of `mamba_ssd.ssd_chunk_scan`; tile options as in `_launch`."""
    return _launch(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   states=initial_states, pool_index=None, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   interpret=interpret, block_t=block_t, block_p=block_p, num_warps=num_warps, num_stages=num_stages)


def ssd_chunk_scan_pooled_pallas(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, state_pool, slot_ids,
                                 has_initial_state, dt_softplus=True, dt_limit=None, interpret=False, block_t=None,
                                 block_p=None, num_warps=4, num_stages=2):
    """Kernel entry point of `mamba_ssd.ssd_chunk_scan_pooled`: -> (y, state_pool updated in place)."""
    pool_index = (slot_ids.astype(jnp.int32), has_initial_state.astype(jnp.int32))
    return _launch(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                   states=state_pool, pool_index=pool_index, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   interpret=interpret, block_t=block_t, block_p=block_p, num_warps=num_warps, num_stages=num_stages)
