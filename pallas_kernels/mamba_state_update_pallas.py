"""Pallas (Triton) kernel of the Mamba2 decode state update; semantics in `mamba_state_update`'s docstring.

Memory-bound: each request reads and writes its [H, P, N] float32 state once, so the kernel is a streaming
read-modify-write. One program per (request, head, head-dim block): it loads the slot id, a [BP, N] state tile (a
contiguous run of memory, since the state is [slots, H, P, N] row-major), updates it in float32, stores it back into
the same buffer (input_output_aliases: the donated pool is updated in place) and reduces it against C for y.

Requests with slot id 0 (padding) read and write slot 0 only; several may race on it, which only makes the null
slot's garbage nondeterministic. P is tiled by its largest power-of-two divisor (80 -> 16, 64 -> 32, capped at 32), so
no lanes are wasted on padding; N is padded up to a power of two by masked loads.

x, dt, B and C are read as rows of 2-D arrays at static column offsets, so the model can hand over its packed
tensors (the conv output x‖B‖C, in_proj's output for dt) without slicing them apart: on the GPU each slice that feeds
a custom call is a copy kernel of its own.
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


def _update_kernel(slot_ref, x_ref, dt_ref, a_ref, d_ref, dtb_ref, b_ref, c_ref, state_in_ref, y_ref, state_ref, *,
                   P, N, R, BP, BN, npb, dt_softplus, a_log, x_off, b_off, c_off, dt_off, request_axis, evict):
    del state_in_ref  # aliased to state_ref
    b = pl.program_id(request_axis)
    h, g, p0, pmask, nmask, pn_mask = head_tile(pl.program_id(1 - request_axis), npb=npb, BP=BP, BN=BN, P=P, N=N,
                                                R=R)
    slot = slot_ref[b]

    dt = dt_ref[b, dt_off + h].astype(_f32) + dtb_ref[h].astype(_f32)
    if dt_softplus:
        dt = softplus(dt)
    a = a_ref[h].astype(_f32)
    decay = jnp.exp(dt * (-jnp.exp(a) if a_log else a))
    x = plgpu.load(x_ref.at[b, pl.ds(x_off + h * P + p0, BP)], mask=pmask, other=0.0).astype(_f32)
    bv = plgpu.load(b_ref.at[b, pl.ds(b_off + g * N, BN)], mask=nmask, other=0.0).astype(_f32)
    cv = plgpu.load(c_ref.at[b, pl.ds(c_off + g * N, BN)], mask=nmask, other=0.0).astype(_f32)
    tile = state_ref.at[slot, h, pl.ds(p0, BP), pl.ds(0, BN)]
    st = plgpu.load(tile, mask=pn_mask, other=0.0, eviction_policy=evict).astype(_f32)
    st = st * decay + (dt * x)[:, None] * bv[None, :]
    plgpu.store(tile, st.astype(state_ref.dtype), mask=pn_mask, eviction_policy=evict)
    y = jnp.sum(st * cv[None, :], axis=1) + d_ref[h].astype(_f32) * x
    plgpu.store(y_ref.at[b, h, pl.ds(p0, BP)], y.astype(y_ref.dtype), mask=pmask)


@functools.partial(jax.jit, static_argnames=("G", "offsets", "dt_softplus", "a_log", "block_p", "num_warps",
                                             "requests_first", "stream", "interpret"))
def _update_pallas(state, x, dt, A, B, C, D, dt_bias, slot_ids, *, G, offsets, dt_softplus, a_log, block_p, num_warps,
                   requests_first=False, stream=False, interpret):
    """x, dt, B, C: 2-D [batch, columns]; offsets = their first columns (x, B, C, dt).

    Launch order: by default the grid's first axis (which Triton launches fastest) walks one request's state
    (contiguous in the pool) tile after tile, its x, B and C rows shared by neighbouring programs. `requests_first`
    puts the request there instead, so programs running together update the same tile of many requests' states, 5 MB
    apart: on the H200 (2026-12-02, `bench/mamba_kernels.py --tune-update`, B=256) that moved Nano-9B's fp32 state at
    3.71 TB/s against 3.87 for the default (723 against 693 us), bf16 375 against 362 us. `stream` marks the state's
    loads and stores evict-first (each byte is touched once, so the L2 need not keep it): no gain in the same sweep,
    off."""
    H, P, N = state.shape[1:]
    Bsz = x.shape[0]
    BP = largest_pow2_divisor(P, block_p)  # no masked-off lanes
    npb = P // BP
    BN = next_pow2(N)
    x_off, b_off, c_off, dt_off = offsets
    kernel = functools.partial(_update_kernel, P=P, N=N, R=H // G, BP=BP, BN=BN, npb=npb, dt_softplus=dt_softplus,
                               a_log=a_log, x_off=x_off, b_off=b_off, c_off=c_off, dt_off=dt_off,
                               request_axis=0 if requests_first else 1, evict="evict_first" if stream else None)
    return pl.pallas_call(
        kernel,
        grid=(Bsz, H * npb) if requests_first else (H * npb, Bsz),
        out_shape=(jax.ShapeDtypeStruct((Bsz, H, P), x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)),
        input_output_aliases={8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="ssd_state_update",
    )(slot_ids.astype(jnp.int32), x, dt, A, D, dt_bias, B, C, state)


def _defaults(H, D, dt_bias):
    return (jnp.zeros((H,), _f32) if D is None else D), (jnp.zeros((H,), _f32) if dt_bias is None else dt_bias)


def ssd_state_update_pallas(state, x, dt, A, B, C, *, D, dt_bias, slot_ids, dt_softplus=True, interpret=False,
                            block_p=32, num_warps=4, requests_first=False, stream=False):
    Bsz, H, P = x.shape
    G = B.shape[1]
    D, dt_bias = _defaults(H, D, dt_bias)
    flat = lambda a: a.reshape(Bsz, -1)  # free: row-major
    return _update_pallas(state, flat(x), dt, A, flat(B), flat(C), D, dt_bias, slot_ids, G=G, offsets=(0, 0, 0, 0),
                          dt_softplus=dt_softplus, a_log=False, block_p=block_p, num_warps=num_warps,
                          requests_first=requests_first, stream=stream, interpret=interpret)


def ssd_state_update_packed_pallas(state, xbc, dt, A_log, *, n_groups, dt_offset, D, dt_bias, slot_ids,
                                   dt_softplus=True, interpret=False, block_p=32, num_warps=4, requests_first=False,
                                   stream=False):
    H, P, N = state.shape[1:]
    D, dt_bias = _defaults(H, D, dt_bias)
    offsets = (0, H * P, H * P + n_groups * N, dt_offset)
    return _update_pallas(state, xbc, dt, A_log, xbc, xbc, D, dt_bias, slot_ids, G=n_groups, offsets=offsets,
                          dt_softplus=dt_softplus, a_log=True, block_p=block_p, num_warps=num_warps,
                          requests_first=requests_first, stream=stream, interpret=interpret)
