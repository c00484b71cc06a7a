"""Mamba2 decode step (one token per request) through a slot-indexed state pool: Pallas kernel and XLA reference.

For request b with slot s = slot_ids[b], with dt = softplus(dt + dt_bias) and head h reading group h // (H // G):

    state[s, h] <- exp(dt[b,h] * A[h]) * state[s, h] + dt[b,h] * x[b,h] ⊗ B[b, g]        [P, N]
    y[b, h]      = state[s, h] · C[b, g] + D[h] * x[b, h]

Slot 0 is the null slot of padded requests: a request with slot id 0 reads and writes slot 0 only, so it never
modifies a real slot (slot 0 may end up holding garbage). Slots not named in slot_ids are untouched. Real requests
must own distinct slots. The state pool is meant to be donated by the caller; the kernel updates it in place
(input_output_aliases), the reference through a scatter that XLA does in place when the caller donates the pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._dispatch import resolve_impl

_HI = lax.Precision.HIGHEST


def _prepare_dt(dt, dt_bias, dt_softplus):
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    return dt


@functools.partial(jax.jit, static_argnames=("dt_softplus",))
def ssd_state_update_xla(state, x, dt, A, B, C, *, D, dt_bias, slot_ids, dt_softplus=True):
    """Vectorised over requests: gather the slots, update in float32, scatter back."""
    Bsz, H, P = x.shape
    G, N = B.shape[1:]
    R = H // G
    slot_ids = slot_ids.astype(jnp.int32)
    dtf = _prepare_dt(dt, dt_bias, dt_softplus)  # [B, H]
    h0 = state[slot_ids].astype(jnp.float32).reshape(Bsz, G, R, P, N)
    dA = jnp.exp(dtf * A.astype(jnp.float32)[None, :]).reshape(Bsz, G, R)
    xf = x.astype(jnp.float32)
    dtx = (xf * dtf[..., None]).reshape(Bsz, G, R, P)
    Bf = B.astype(jnp.float32)
    Cf = C.astype(jnp.float32)
    h1 = h0 * dA[..., None, None] + dtx[..., None] * Bf[:, :, None, None, :]
    y = jnp.einsum("bgrpn,bgn->bgrp", h1, Cf, precision=_HI).reshape(Bsz, H, P)
    if D is not None:
        y = y + D.astype(jnp.float32)[None, :, None] * xf
    # Padded requests all write slot 0; duplicate writes there leave garbage, which the null slot is allowed to hold.
    new_state = state.at[slot_ids].set(h1.reshape(Bsz, H, P, N).astype(state.dtype))
    return y.astype(x.dtype), new_state


def ssd_state_update(state, x, dt, A, B, C, *, D, dt_bias, slot_ids, dt_softplus=True, impl="auto",
                     interpret=False):
    """Decode step: state[slots,H,P,N], x[B,H,P], dt[B,H], A[H], B/C[B,G,N], slot_ids[B] -> (y[B,H,P], state)."""
    Bsz, H, P = x.shape
    G, N = B.shape[1:]
    if state.shape[1:] != (H, P, N) or dt.shape != (Bsz, H) or C.shape != (Bsz, G, N) or A.shape != (H,):
        raise ValueError(f"shape mismatch: state{state.shape} x{x.shape} dt{dt.shape} A{A.shape} B{B.shape} "
                         f"C{C.shape}")
    if H % G:
        raise ValueError(f"heads {H} not a multiple of groups {G}")
    if slot_ids.shape != (Bsz,):
        raise ValueError(f"slot_ids must be [{Bsz}], got {slot_ids.shape}")
    which = resolve_impl(impl, interpret, kernel="ssd_state_update")
    if which == "xla":
        return ssd_state_update_xla(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, slot_ids=slot_ids,
                                    dt_softplus=dt_softplus)
    from pallas_kernels.mamba_state_update_pallas import ssd_state_update_pallas

    return ssd_state_update_pallas(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, slot_ids=slot_ids,
                                   dt_softplus=dt_softplus, interpret=interpret)


def ssd_state_update_packed(state, xbc, dt, A_log, *, n_groups, dt_offset=0, D, dt_bias, slot_ids,
                            dt_softplus=True, impl="auto", interpret=False):
    """The decode step on Mamba2's packed tensors: xbc[B, H*P + 2*G*N] (the conv output x‖B‖C), the raw dt as the
    columns dt[:, dt_offset : dt_offset + H] (in_proj's whole output may be passed), and A = -exp(A_log).
    -> (y[B,H,P], state), equal to `ssd_state_update` on the pieces.

    Why a second entry: on the GPU, each piece sliced out of a packed tensor for a custom call is a copy kernel of
    its own (four per Mamba layer and decode step), and A = -exp(A_log) one more; the kernel reads the pieces at
    their offsets instead. H, P and N come from the state pool [slots, H, P, N].
    """
    Bsz = xbc.shape[0]
    H, P, N = state.shape[1:]
    G = n_groups
    if xbc.shape[1] != H * P + 2 * G * N or H % G or A_log.shape != (H,) or dt.shape[1] < dt_offset + H:
        raise ValueError(f"shape mismatch: state{state.shape} xbc{xbc.shape} dt{dt.shape} (offset {dt_offset}) "
                         f"A_log{A_log.shape} groups {G}")
    if resolve_impl(impl, interpret, kernel="ssd_state_update") == "xla":
        x, B, C = jnp.split(xbc, [H * P, H * P + G * N], axis=-1)
        return ssd_state_update_xla(
            state, x.reshape(Bsz, H, P), dt[:, dt_offset:dt_offset + H], -jnp.exp(A_log.astype(jnp.float32)),
            B.reshape(Bsz, G, N), C.reshape(Bsz, G, N), D=D, dt_bias=dt_bias, slot_ids=slot_ids,
            dt_softplus=dt_softplus)
    from pallas_kernels.mamba_state_update_pallas import ssd_state_update_packed_pallas

    return ssd_state_update_packed_pallas(state, xbc, dt, A_log, n_groups=G, dt_offset=dt_offset, D=D,
                                          dt_bias=dt_bias, slot_ids=slot_ids, dt_softplus=dt_softplus,
                                          interpret=interpret)
