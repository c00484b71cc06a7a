"""Pallas (Triton) kernels of speculative decoding's Mamba2 verify scan and commit; semantics in `mamba_verify`.

Both are the decode state update (`mamba_state_update_pallas`) with a loop over a request's L tokens inside: one
program per (head, head-dim block, request) loads its [BP, N] state tile once, runs the L updates in float32 with the
tile in registers (rounded to the pool's dtype between tokens, as the pool would store it between decode steps), and
- verify: writes each token's y and leaves the pool alone;
- commit: keeps the update of tokens t < lengths[request] only and stores the tile back in place
  (input_output_aliases: the donated pool).
So the state is read once by each and written once by the commit: the bytes a decode step moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dispatch import largest_pow2_divisor, next_pow2
from pallas_kernels._mamba_tiles import head_tile, softplus

_f32 = jnp.float32


def _token(xbc_ref, dt_ref, row, h, g, p0, pmask, nmask, *, P, N, H, G, BP, BN, dt_off, dtb, a, with_c):
    """Token `row`'s pieces for head h's tile: (dt, decay, x[BP], B[BN], C[BN] or None)."""
    dt = softplus(dt_ref[row, dt_off + h].astype(_f32) + dtb)
    x = plgpu.load(xbc_ref.at[row, pl.ds(h * P + p0, BP)], mask=pmask, other=0.0).astype(_f32)
    bv = plgpu.load(xbc_ref.at[row, pl.ds(H * P + g * N, BN)], mask=nmask, other=0.0).astype(_f32)
    cv = (plgpu.load(xbc_ref.at[row, pl.ds(H * P + G * N + g * N, BN)], mask=nmask, other=0.0).astype(_f32)
          if with_c else None)
    return dt, jnp.exp(dt * a), x, bv, cv


def _verify_kernel(slot_ref, xbc_ref, dt_ref, alog_ref, d_ref, dtb_ref, state_ref, y_ref, *, L, P, N, H, G, BP, BN,
                   npb, dt_off):
    b = pl.program_id(1)
    h, g, p0, pmask, nmask, pn_mask = head_tile(pl.program_id(0), npb=npb, BP=BP, BN=BN, P=P, N=N, R=H // G)
    tile = state_ref.at[slot_ref[b], h, pl.ds(p0, BP), pl.ds(0, BN)]
    st = plgpu.load(tile, mask=pn_mask, other=0.0).astype(_f32)
    a, dtb, d = -jnp.exp(alog_ref[h].astype(_f32)), dtb_ref[h].astype(_f32), d_ref[h].astype(_f32)
    for t in range(L):
        row = b * L + t
        dt, decay, x, bv, cv = _token(xbc_ref, dt_ref, row, h, g, p0, pmask, nmask, P=P, N=N, H=H, G=G, BP=BP,
                                      BN=BN, dt_off=dt_off, dtb=dtb, a=a, with_c=True)
        st = st * decay + (dt * x)[:, None] * bv[None, :]
        y = jnp.sum(st * cv[None, :], axis=1) + d * x
        plgpu.store(y_ref.at[row, h, pl.ds(p0, BP)], y.astype(y_ref.dtype), mask=pmask)
        st = st.astype(state_ref.dtype).astype(_f32)


def _advance_kernel(slot_ref, len_ref, xbc_ref, dt_ref, alog_ref, dtb_ref, state_in_ref, state_ref, *, L, P, N, H, G,
                    BP, BN, npb, dt_off):
    del state_in_ref  # aliased to state_ref
    b = pl.program_id(1)
    h, g, p0, pmask, nmask, pn_mask = head_tile(pl.program_id(0), npb=npb, BP=BP, BN=BN, P=P, N=N, R=H // G)
    tile = state_ref.at[slot_ref[b], h, pl.ds(p0, BP), pl.ds(0, BN)]
    st = plgpu.load(tile, mask=pn_mask, other=0.0).astype(_f32)
    a, dtb, n = -jnp.exp(alog_ref[h].astype(_f32)), dtb_ref[h].astype(_f32), len_ref[b]
    for t in range(L):
        dt, decay, x, bv, _ = _token(xbc_ref, dt_ref, b * L + t, h, g, p0, pmask, nmask, P=P, N=N, H=H, G=G, BP=BP,
                                     BN=BN, dt_off=dt_off, dtb=dtb, a=a, with_c=False)
        advanced = (st * decay + (dt * x)[:, None] * bv[None, :]).astype(state_ref.dtype).astype(_f32)
        st = jnp.where(t < n, advanced, st)
    plgpu.store(tile, st.astype(state_ref.dtype), mask=pn_mask)


def _warps(requests: int) -> int:
    """Warps per program. On the H200 (2026-12-04, `bench/mamba_kernels.py --tune-verify`, Nano-9B, fp32 state) one
    warp was fastest from 32 requests up (B=32, L=2: scan 66.7 us against 76.3 with four warps, commit 90.7 against
    95.7; B=256: 381 against 445 and 660 against 700: more programs in flight per SM); at one request, with only 640
    programs, four (56.9 against 65.0 us)."""
    return 1 if requests >= 8 else 4


def _geometry(state, block_p):
    H, P, N = state.shape[1:]
    BP = largest_pow2_divisor(P, block_p)  # no masked-off lanes
    return dict(P=P, N=N, H=H, BP=BP, BN=next_pow2(N), npb=P // BP)


@functools.partial(jax.jit, static_argnames=("n_groups", "length", "dt_offset", "block_p", "num_warps", "interpret"))
def ssd_verify_scan_pallas(state, xbc, dt, A_log, *, n_groups, length, dt_offset, D, dt_bias, slot_ids,
                           block_p=32, num_warps=None, interpret=False):
    geometry = _geometry(state, block_p)
    S = slot_ids.shape[0]
    H, P = geometry["H"], geometry["P"]
    num_warps = num_warps or _warps(S)
    kernel = functools.partial(_verify_kernel, L=length, G=n_groups, dt_off=dt_offset, **geometry)
    return pl.pallas_call(
        kernel,
        grid=(H * geometry["npb"], S),  # a request's tiles side by side: its state is contiguous in the pool
        out_shape=jax.ShapeDtypeStruct((S * length, H, P), xbc.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ssd_verify_scan",
    )(slot_ids.astype(jnp.int32), xbc, dt, A_log, D, dt_bias, state)


@functools.partial(jax.jit, static_argnames=("n_groups", "length", "dt_offset", "block_p", "num_warps", "interpret"))
def ssd_state_advance_pallas(state, xbc, dt, A_log, *, n_groups, length, dt_offset, dt_bias, slot_ids, lengths,
                             block_p=32, num_warps=None, interpret=False):
    geometry = _geometry(state, block_p)
    S = slot_ids.shape[0]
    num_warps = num_warps or _warps(S)
    kernel = functools.partial(_advance_kernel, L=length, G=n_groups, dt_off=dt_offset, **geometry)
    return pl.pallas_call(
        kernel,
        grid=(geometry["H"] * geometry["npb"], S),
        out_shape=jax.ShapeDtypeStruct(state.shape, state.dtype),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ssd_state_advance",
    )(slot_ids.astype(jnp.int32), lengths.astype(jnp.int32), xbc, dt, A_log, dt_bias, state)
