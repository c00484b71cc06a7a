"""Mamba2 SSD chunk scan over packed variable-length sequences (prefill), as a Pallas kernel and its XLA reference.

Semantics are those of Hugging Face `transformers`' NemotronH / Mamba2 `torch_forward` chunk path, per sequence:

    dt_t  = softplus(dt_t + dt_bias)            (when dt_softplus; then clamped to dt_limit when one is given)
    h_t   = exp(dt_t * A) * h_{t-1} + dt_t * x_t ⊗ B_t        h: [H, P, N], starting from the initial state (or 0)
    y_t   = C_t · h_t + D * x_t

with head h reading group h // (H // G) of B and C. `A` is the already negative `-exp(A_log)`.

Chunking of packed sequences: chunk boundaries are aligned to sequence starts, so a chunk never holds tokens of two
sequences (vLLM does the same). Sequence s of length n_s owns ceil(n_s / chunk_size) chunks, the last one possibly
short; the chunk count is therefore at most T // chunk_size + S, a static bound, and `packing.aligned_blocks` builds
the (sequence, start token, length) table with traced `cu_seqlens`. Aligning chunks instead of masking by sequence
id keeps every chunk's arithmetic that of a single sequence and lets the kernel carry one state per sequence.

Tokens at positions >= cu_seqlens[-1] (bucket padding) belong to no sequence: their y is 0 and they touch no state.
Empty sequences are allowed: their final state is their initial state.

Precision: every product is accumulated in float32; y comes back in x's dtype, final states in float32.

Pooled variant (`ssd_chunk_scan_pooled`), for the serving engine's extend step: the same scan, but states live in
the Mamba slot pool `state_pool[num_slots, H, P, N]` (float32, bfloat16 or float16). Sequence s starts from
`state_pool[slot_ids[s]]` (read in float32) when `has_initial_state[s]`, else from zeros, and its final state is
written back to `state_pool[slot_ids[s]]` in the pool's dtype. Empty sequences (padding rows, on the null slot 0)
read and write nothing, so every slot not named by a non-empty sequence is bit-identical afterwards; non-empty
sequences must name distinct slots. The caller donates the pool: the kernel updates it in place and touches only the
slots of real sequences, where gathering [S, H, P, N] initial states and scattering the finals back would move the
state of every row, padding included (5.2 MB per row at Nano-9B's H=128, P=80, N=128 in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._dispatch import resolve_impl
from pallas_kernels.packing import aligned_blocks, check_pool_index, pool_rows, token_sequences

_HI = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------------------------
# Packed-sequence bookkeeping shared by the reference and the kernel
# ----------------------------------------------------------------------------------------------------------------


def _prepare_dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    if dt_limit is not None:
        dt = jnp.clip(dt, dt_limit[0], dt_limit[1])
    return dt


def _check_shapes(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states):
    T, H, P = x.shape
    G, N = B.shape[1:]
    if dt.shape != (T, H) or A.shape != (H,) or B.shape != (T, G, N) or C.shape != (T, G, N):
        raise ValueError(f"shape mismatch: x{x.shape} dt{dt.shape} A{A.shape} B{B.shape} C{C.shape}")
    if H % G:
        raise ValueError(f"heads {H} not a multiple of groups {G}")
    if D is not None and D.shape != (H,):
        raise ValueError(f"D must be [H]={H}, got {D.shape}")
    if dt_bias is not None and dt_bias.shape != (H,):
        raise ValueError(f"dt_bias must be [H]={H}, got {dt_bias.shape}")
    S = cu_seqlens.shape[0] - 1
    if initial_states is not None and initial_states.shape != (S, H, P, N):
        raise ValueError(f"initial_states must be {(S, H, P, N)}, got {initial_states.shape}")


def _check_pool(x, B, cu_seqlens, state_pool, slot_ids, has_initial_state):
    H, P = x.shape[1:]
    N = B.shape[2]
    S = cu_seqlens.shape[0] - 1
    if state_pool.ndim != 4 or state_pool.shape[1:] != (H, P, N):
        raise ValueError(f"state_pool must be [num_slots, {H}, {P}, {N}], got {state_pool.shape}")
    if state_pool.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"state_pool must be float32, bfloat16 or float16, got {state_pool.dtype}")
    check_pool_index(S, slot_ids, has_initial_state)


def _static_dt_limit(dt_limit):
    """Plain floats, so the limit can be a static (hashable) jit argument."""
    return None if dt_limit is None else (float(dt_limit[0]), float(dt_limit[1]))


# ----------------------------------------------------------------------------------------------------------------
# XLA reference
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit"))
def ssd_chunk_scan_xla(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, initial_states=None,
                       dt_softplus=True, dt_limit=None):
    """Exact float32 chunked SSD in jnp (the Mamba2 "minimal" decomposition, on sequence-aligned chunks)."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    S = cu_seqlens.shape[0] - 1
    L = chunk_size
    tab = aligned_blocks(cu_seqlens, T, L)
    nc = tab["seq"].shape[0]

    dtf = _prepare_dt(dt, dt_bias, dt_softplus, dt_limit)
    pos = jnp.arange(L, dtype=jnp.int32)
    idx = jnp.clip(tab["start"][:, None] + pos[None, :], 0, T - 1)  # [NC, L]
    m = pos[None, :] < tab["length"][:, None]  # [NC, L]
    xc = jnp.where(m[..., None, None], x[idx].astype(jnp.float32), 0.0)  # [NC, L, H, P]
    dtc = jnp.where(m[..., None], dtf[idx], 0.0)  # [NC, L, H]; padded rows: dt = 0 -> no decay, no input
    Bc = jnp.where(m[..., None, None], B[idx].astype(jnp.float32), 0.0).reshape(nc, L, G, 1, N)
    Cc = jnp.where(m[..., None, None], C[idx].astype(jnp.float32), 0.0).reshape(nc, L, G, 1, N)

    dA = dtc * A.astype(jnp.float32)[None, None, :]  # [NC, L, H]
    cum = jnp.cumsum(dA, axis=1)  # [NC, L, H]
    cum_g = cum.reshape(nc, L, G, R)
    dtx = (xc * dtc[..., None]).reshape(nc, L, G, R, P)

    # 1. intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) dt_s x_s
    CB = jnp.einsum("clgn,csgn->cgls", Cc[:, :, :, 0], Bc[:, :, :, 0], precision=_HI)  # [NC, G, L, L]
    causal = pos[:, None] >= pos[None, :]
    diff = cum_g.transpose(0, 2, 3, 1)[..., :, None] - cum_g.transpose(0, 2, 3, 1)[..., None, :]  # [NC,G,R,L,L]
    decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))
    y_diag = jnp.einsum("cgls,cgrls,csgrp->clgrp", CB, decay, dtx, precision=_HI)

    # 2. state contributed by each chunk alone: sum_s exp(cum_last - cum_s) dt_s x_s ⊗ B_s
    decay_states = jnp.exp(cum_g[:, -1:] - cum_g)  # [NC, L, G, R]
    chunk_states = jnp.einsum("clgr,clgrp,clgn->cgrpn", decay_states, dtx, Bc[:, :, :, 0], precision=_HI)
    chunk_states = chunk_states.reshape(nc, H, P, N)
    chunk_decay = jnp.exp(cum[:, -1])  # [NC, H]

    # 3. state passing across chunks, sequentially; a chunk that opens a sequence restarts from its initial state.
    if initial_states is None:
        init = jnp.zeros((S, H, P, N), jnp.float32)
    else:
        init = initial_states.astype(jnp.float32)

    def step(carry, inp):
        state, finals = carry
        seq, first, last, cs, cd = inp
        state = jnp.where(first, init[seq], state)
        start_state = state
        state = state * cd[:, None, None] + cs
        finals = finals.at[seq].set(jnp.where(last, state, finals[seq]))
        return (state, finals), start_state

    (_, final_states), start_states = lax.scan(
        step, (jnp.zeros((H, P, N), jnp.float32), init),
        (tab["seq"], tab["first"], tab["last"], chunk_states, chunk_decay))

    # 4. contribution of the state entering each chunk: y_l += exp(cum_l) C_l . h_start
    y_off = jnp.einsum("clgn,cgrpn->clgrp", Cc[:, :, :, 0], start_states.reshape(nc, G, R, P, N), precision=_HI)
    y_off = y_off * jnp.exp(cum_g)[..., None]
    yc = (y_diag + y_off).reshape(nc, L, H, P)

    # Back from chunk layout to tokens.
    tseq, off, tvalid = token_sequences(cu_seqlens, T)
    tchunk = jnp.clip(tab["block_begin"][tseq] + off // L, 0, nc - 1)
    y = yc[tchunk, off % L]
    if D is not None:
        y = y + D.astype(jnp.float32)[None, :, None] * x.astype(jnp.float32)
    y = jnp.where(tvalid[:, None, None], y, 0.0)
    return y.astype(x.dtype), final_states


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit", "write_states"))
def ssd_chunk_scan_pooled_xla(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, state_pool, slot_ids,
                              has_initial_state, dt_softplus=True, dt_limit=None, write_states=True):
    """The reference on pool rows: gather the initial states, scan, scatter the finals back (rows as in
    `packing.pool_rows`)."""
    read_rows, write_rows = pool_rows(cu_seqlens, slot_ids, has_initial_state, state_pool.shape[0])
    initial_states = state_pool.at[read_rows].get(mode="fill", fill_value=0).astype(jnp.float32)
    y, final_states = ssd_chunk_scan_xla(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                                         chunk_size=chunk_size, initial_states=initial_states,
                                         dt_softplus=dt_softplus, dt_limit=dt_limit)
    if not write_states:
        return y, state_pool
    return y, state_pool.at[write_rows].set(final_states.astype(state_pool.dtype), mode="drop")


# ----------------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------------


def ssd_chunk_scan(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, initial_states=None, dt_softplus=True,
                   dt_limit=None, impl="auto", interpret=False):
    """Packed variable-length Mamba2 SSD scan: x[T,H,P], dt[T,H], A[H], B/C[T,G,N] -> (y[T,H,P], states[S,H,P,N]).

    `dt_limit=(lo, hi)` clamps dt after the softplus (mamba_ssm's `dt_limit`); None (the default) clamps nothing.
    HF's NemotronH mixer passes its config's `time_step_limit` here in its chunk path.
    """
    _check_shapes(x, dt, A, B, C, D, dt_bias, cu_seqlens, initial_states)
    dt_limit = _static_dt_limit(dt_limit)
    which = resolve_impl(impl, interpret, kernel="ssd_chunk_scan")
    if which == "xla":
        return ssd_chunk_scan_xla(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                                  chunk_size=chunk_size, initial_states=initial_states, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit)
    from pallas_kernels.mamba_ssd_pallas import ssd_chunk_scan_pallas

    return ssd_chunk_scan_pallas(x, dt, A, B, C, D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                                 chunk_size=chunk_size, initial_states=initial_states, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit, interpret=interpret)


def ssd_chunk_scan_pooled(x, dt, A, B, C, *, D, dt_bias, cu_seqlens, chunk_size, state_pool, slot_ids,
                          has_initial_state, dt_softplus=True, dt_limit=None, write_states=True, impl="auto",
                          interpret=False, **kernel_options):
    """`ssd_chunk_scan` with states in the slot pool (see the module docstring): state_pool[num_slots, H, P, N],
    slot_ids int32[S], has_initial_state bool[S] -> (y[T, H, P], state_pool). Donate the pool to update it in place.
    `write_states=False` only reads the pool (it comes back as it was): outputs from each slot's state without
    moving it, for speculative decoding's verify step, which commits the state later.

    `kernel_options` (block_t, block_p, segment_len, state_block_t, prefetch, num_warps, num_stages; see
    `mamba_ssd_pallas._launch`) tune the Pallas kernel; the XLA reference has none and ignores them.
    """
    _check_shapes(x, dt, A, B, C, D, dt_bias, cu_seqlens, None)
    _check_pool(x, B, cu_seqlens, state_pool, slot_ids, has_initial_state)
    common = dict(D=D, dt_bias=dt_bias, cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_pool=state_pool,
                  slot_ids=slot_ids, has_initial_state=has_initial_state, dt_softplus=dt_softplus,
                  dt_limit=_static_dt_limit(dt_limit), write_states=write_states)
    if resolve_impl(impl, interpret, kernel="ssd_chunk_scan_pooled") == "xla":
        return ssd_chunk_scan_pooled_xla(x, dt, A, B, C, **common)
    from pallas_kernels.mamba_ssd_pallas import ssd_chunk_scan_pooled_pallas

    return ssd_chunk_scan_pooled_pallas(x, dt, A, B, C, **common, interpret=interpret, **kernel_options)
