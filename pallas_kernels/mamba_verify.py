"""Mamba2 for speculative decoding's VERIFY step: L tokens per request from each slot's state, then the commit of the
accepted ones. XLA references here, Pallas (Triton) kernels in `mamba_verify_pallas`.

Both take Mamba2's packed tensors as the decode update does (`mamba_state_update.ssd_state_update_packed`): the conv
output xbc[S*L, H*P + 2*G*N] (x‖B‖C, request s's tokens in rows s*L .. s*L+L-1), the raw dt as the columns
dt[:, dt_offset : dt_offset + H] of in_proj's output, and A = -exp(A_log).

- `ssd_verify_scan_packed` -> y[S*L, H, P]: each token's output as that many decode steps would give it (the state
  rounded to the pool's dtype between tokens, as the pool stores it between steps). The pool is only read.
- `ssd_state_advance_packed` -> the pool with each request's slot advanced by its first lengths[s] tokens, the same
  recurrence: the commit, once the step knows how many drafts stand.

Why the token recurrence and not the chunked scan: with L <= 5 tokens a request the scan's chunk machinery costs more
than the state traffic (on the H200 the chunked scan read the state at about a third of the bandwidth, 2026-12-01),
and the recurrence gives exactly the decode steps' numbers. Each kernel reads a request's state once; the verify one
keeps it on chip across the L tokens and writes nothing back, the commit one writes it once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._dispatch import resolve_impl

_HI = lax.Precision.HIGHEST


def _unpack(state, xbc, dt, A_log, dt_bias, *, n_groups, length, dt_offset):
    """-> x[S,L,G,R,P], dt[S,L,G,R] (softplus(dt + dt_bias), float32), A[G,R], B[S,L,G,N], C[S,L,G,N]."""
    H, P, N = state.shape[1:]
    G, L = n_groups, length
    S = xbc.shape[0] // L
    x, B, C = jnp.split(xbc.astype(jnp.float32), [H * P, H * P + G * N], axis=-1)
    dtf = jax.nn.softplus(dt[:, dt_offset:dt_offset + H].astype(jnp.float32) + dt_bias.astype(jnp.float32))
    A = -jnp.exp(A_log.astype(jnp.float32))
    return (x.reshape(S, L, G, H // G, P), dtf.reshape(S, L, G, H // G), A.reshape(G, H // G),
            B.reshape(S, L, G, N), C.reshape(S, L, G, N))


def _advance(h, x, dt, A, B, t):
    """The decode recurrence's update of h[S,G,R,P,N] (float32) by token t."""
    decay = jnp.exp(dt[:, t] * A)
    return h * decay[..., None, None] + (x[:, t] * dt[:, t][..., None])[..., None] * B[:, t][:, :, None, None, :]


def _rounded(h, dtype):
    """h as the pool stores it, kept in float32 for the next token. reduce_precision, not a convert pair: XLA's GPU
    compiler drops a float32 -> bfloat16 -> float32 pair as if it were exact (`xla_allow_excess_precision`)."""
    if jnp.dtype(dtype) == jnp.float32:
        return h
    info = jnp.finfo(dtype)
    return lax.reduce_precision(h, exponent_bits=info.nexp, mantissa_bits=info.nmant)


@functools.partial(jax.jit, static_argnames=("n_groups", "length", "dt_offset"))
def ssd_verify_scan_xla(state, xbc, dt, A_log, *, n_groups, length, dt_offset, D, dt_bias, slot_ids):
    H, P, N = state.shape[1:]
    x, dtf, A, B, C = _unpack(state, xbc, dt, A_log, dt_bias, n_groups=n_groups, length=length, dt_offset=dt_offset)
    S = x.shape[0]
    h = state[slot_ids.astype(jnp.int32)].astype(jnp.float32).reshape(S, n_groups, H // n_groups, P, N)
    Df = D.astype(jnp.float32).reshape(n_groups, H // n_groups)
    ys = []
    for t in range(length):
        h = _advance(h, x, dtf, A, B, t)
        ys.append(jnp.einsum("sgrpn,sgn->sgrp", h, C[:, t], precision=_HI) + Df[..., None] * x[:, t])
        h = _rounded(h, state.dtype)
    return jnp.stack(ys, axis=1).reshape(S * length, H, P).astype(xbc.dtype)


@functools.partial(jax.jit, static_argnames=("n_groups", "length", "dt_offset"))
def ssd_state_advance_xla(state, xbc, dt, A_log, *, n_groups, length, dt_offset, dt_bias, slot_ids, lengths):
    H, P, N = state.shape[1:]
    x, dtf, A, B, _ = _unpack(state, xbc, dt, A_log, dt_bias, n_groups=n_groups, length=length, dt_offset=dt_offset)
    S = x.shape[0]
    slot_ids = slot_ids.astype(jnp.int32)
    h = state[slot_ids].astype(jnp.float32).reshape(S, n_groups, H // n_groups, P, N)
    for t in range(length):  # unrolled: the L <= 5 updates fuse into one pass over the gathered states
        h = jnp.where((t < lengths)[:, None, None, None, None], _rounded(_advance(h, x, dtf, A, B, t), state.dtype), h)
    return state.at[slot_ids].set(h.reshape(S, H, P, N).astype(state.dtype))


def _check(state, xbc, dt, A_log, n_groups, length, dt_offset, slot_ids):
    H, P, N = state.shape[1:]
    rows = xbc.shape[0]
    if (xbc.shape[1] != H * P + 2 * n_groups * N or H % n_groups or A_log.shape != (H,)
            or dt.shape[0] != rows or dt.shape[1] < dt_offset + H or rows != slot_ids.shape[0] * length):
        raise ValueError(f"shape mismatch: state{state.shape} xbc{xbc.shape} dt{dt.shape} (offset {dt_offset}) "
                         f"A_log{A_log.shape} groups {n_groups} slot_ids{slot_ids.shape} length {length}")


def ssd_verify_scan_packed(state, xbc, dt, A_log, *, n_groups, length, dt_offset, D, dt_bias, slot_ids,
                           impl="auto", interpret=False):
    """L = `length` tokens per request from state[slot_ids[s]] -> y[S*L, H, P]; the pool is not written."""
    _check(state, xbc, dt, A_log, n_groups, length, dt_offset, slot_ids)
    if resolve_impl(impl, interpret, kernel="ssd_verify_scan") == "xla":
        return ssd_verify_scan_xla(state, xbc, dt, A_log, n_groups=n_groups, length=length, dt_offset=dt_offset,
                                   D=D, dt_bias=dt_bias, slot_ids=slot_ids)
    from pallas_kernels.mamba_verify_pallas import ssd_verify_scan_pallas

    return ssd_verify_scan_pallas(state, xbc, dt, A_log, n_groups=n_groups, length=length, dt_offset=dt_offset, D=D,
                                  dt_bias=dt_bias, slot_ids=slot_ids, interpret=interpret)


def ssd_state_advance_packed(state, xbc, dt, A_log, *, n_groups, length, dt_offset, dt_bias, slot_ids, lengths,
                             impl="auto", interpret=False):
    """Advance state[slot_ids[s]] by the first lengths[s] (in 0..L) of request s's L tokens -> the pool, updated in
    place when the caller donates it. Slot 0 is the null slot of padded requests (it may end up holding garbage);
    real requests own distinct slots; slots not named are untouched."""
    _check(state, xbc, dt, A_log, n_groups, length, dt_offset, slot_ids)
    if resolve_impl(impl, interpret, kernel="ssd_state_advance") == "xla":
        return ssd_state_advance_xla(state, xbc, dt, A_log, n_groups=n_groups, length=length, dt_offset=dt_offset,
                                     dt_bias=dt_bias, slot_ids=slot_ids, lengths=lengths)
    from pallas_kernels.mamba_verify_pallas import ssd_state_advance_pallas

    return ssd_state_advance_pallas(state, xbc, dt, A_log, n_groups=n_groups, length=length, dt_offset=dt_offset,
                                    dt_bias=dt_bias, slot_ids=slot_ids, lengths=lengths, interpret=interpret)
