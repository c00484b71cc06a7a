"""Depthwise causal conv1d of Mamba2 over packed variable-length sequences, and its decode step through slots.

Prefill, per sequence s with initial conv state init[s] ([C, K-1], oldest input first; zeros when None):

    window_t = (init[s] ++ x[seq s])[t : t + K]        y_t = act(sum_k weight[:, k] * window_t[k] + bias)

and final_states[s] = the last K-1 entries of init[s] ++ x[seq s], exactly what rolling a conv state through the
sequence token by token leaves behind (so a sequence shorter than K-1 keeps part of its initial state). Tokens at
positions >= cu_seqlens[-1] belong to no sequence: their y is 0.

Pooled prefill (`causal_conv1d_pooled`, the engine's extend step): the same with init[s] = conv_pool[slot_ids[s]]
where has_initial_state[s] (else zeros), and final_states[s] written back to that slot; empty sequences touch no slot.

Decode: window = conv_state[slot] ++ x; y = act(window · weight + bias); conv_state[slot] <- window[1:]. Slot 0 is
the null slot of padded requests (written with garbage, never another slot); slots not in slot_ids are untouched.

Arithmetic in float32; y in x's dtype; conv states keep their own dtype (prefill final states in x's dtype).
`activation` is "silu" (also accepted: "swish") or None.

Packed columns: the prefill and decode entry points take `x_offset`, x being wider than the conv (C = weight.shape[0]) with its
columns x_offset .. x_offset + C the input, and the prefill ones `split_at`, y then being two arrays, y[:, :split_at]
and y[:, split_at:]. Mamba2 convolves the x‖B‖C columns of its in-projection and hands x and B‖C to the scan as
separate operands; on the GPU the slices around the kernel would each be a copy kernel (two a layer, 2.5% of
Nano-9B's 8k prefill: 3.4 + 2.9 ms in the seventeenth H200 run's profile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import resolve_impl
from pallas_kernels.packing import check_pool_index, pool_rows, token_sequences

_ACTS = (None, "silu", "swish")


def _act(y, activation):
    if activation is None:
        return y
    return y * jax.nn.sigmoid(y)


def _check_activation(activation):
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {_ACTS}, got {activation!r}")


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_xla(x, weight, bias, *, cu_seqlens, initial_states=None, activation="silu"):
    T, Cdim = x.shape
    K = weight.shape[1]
    S = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    t = jnp.arange(T, dtype=jnp.int32)
    tseq, off, tvalid = token_sequences(cu, T)
    if initial_states is None:
        init = jnp.zeros((S, Cdim, K - 1), jnp.float32)
    else:
        init = initial_states.astype(jnp.float32)
    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)

    def source(seq, j, tok):
        """Input at position j of sequence `seq` (j < 0 reads the initial state); tok = its packed index."""
        from_x = xf[jnp.clip(tok, 0, T - 1)]
        from_init = init[seq, :, jnp.clip(K - 1 + j, 0, K - 2)] if K > 1 else jnp.zeros_like(from_x)
        return jnp.where((j >= 0)[..., None], from_x, from_init)

    y = jnp.zeros((T, Cdim), jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    for k in range(K):
        shift = K - 1 - k
        y = y + wf[:, k][None, :] * source(tseq, off - shift, t - shift)
    y = jnp.where(tvalid[:, None], _act(y, activation), 0.0)

    lens = cu[1:] - cu[:-1]
    finals = []
    for i in range(K - 1):
        j = lens - (K - 1) + i
        finals.append(source(jnp.arange(S), j, cu[:-1] + j))
    final_dtype = x.dtype if initial_states is None else initial_states.dtype
    final_states = jnp.stack(finals, axis=-1) if K > 1 else jnp.zeros((S, Cdim, 0), jnp.float32)
    return y.astype(x.dtype), final_states.astype(final_dtype)


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_update_xla(x, conv_state, weight, bias, *, slot_ids, activation="silu"):
    slot_ids = slot_ids.astype(jnp.int32)
    window = jnp.concatenate([conv_state[slot_ids].astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=-1)
    y = jnp.sum(window * weight.astype(jnp.float32)[None], axis=-1)
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :]
    y = _act(y, activation)
    new_state = conv_state.at[slot_ids].set(window[:, :, 1:].astype(conv_state.dtype))
    return y.astype(x.dtype), new_state


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d_windows(windows, weight, bias, *, activation="silu"):
    """The conv over whole windows: windows[S, C, K-1+L] (each row's K-1 past inputs, then L new ones) ->
    y[S, L, C], y[s, i] = act(sum_k weight[:, k] * windows[s, :, i + k] + bias), in float32, cast to the windows'
    dtype (what `causal_conv1d_update_xla` computes one token at a time). XLA only: for the few tokens per row of a
    speculative verify step, the K shifted products fuse into one small pass, where the packed kernel would take a
    program per sequence for a handful of tokens."""
    K = weight.shape[1]
    L = windows.shape[2] - (K - 1)
    wf = weight.astype(jnp.float32)
    xf = windows.astype(jnp.float32)
    y = sum(wf[None, :, k, None] * xf[:, :, k: k + L] for k in range(K))
    if bias is not None:
        y = y + bias.astype(jnp.float32)[None, :, None]
    return _act(y, activation).transpose(0, 2, 1).astype(windows.dtype)


def pallas_problem(kernel_size: int) -> str | None:
    """Why the compiled kernels cannot take this conv (they keep a window of K-1 past inputs)."""
    return f"conv kernel size {kernel_size} < 2" if kernel_size < 2 else None


def _check(Cdim: int, weight, bias):
    if weight.ndim != 2 or weight.shape[0] != Cdim:
        raise ValueError(f"weight must be [C={Cdim}, K], got {weight.shape}")
    if bias is not None and bias.shape != (Cdim,):
        raise ValueError(f"bias must be [{Cdim}], got {bias.shape}")


def _check_columns(x, C: int, x_offset: int, split_at=None):
    if x_offset < 0 or x.shape[-1] < x_offset + C:
        raise ValueError(f"x{x.shape} has no columns {x_offset}..{x_offset + C} for a conv of {C} channels")
    if split_at is not None and not 0 < split_at < C:
        raise ValueError(f"split_at={split_at} must fall inside the conv's {C} channels")


def _split_output(y, split_at):
    return y if split_at is None else (y[:, :split_at], y[:, split_at:])


def causal_conv1d(x, weight, bias, *, cu_seqlens, initial_states=None, activation="silu", x_offset=0, split_at=None,
                  impl="auto", interpret=False, **kernel_options):
    """Packed depthwise causal conv: x[T, >= x_offset + C], weight[C,K], bias[C] -> (y[T,C], final_states[S,C,K-1]);
    y is (y[:, :split_at], y[:, split_at:]) given `split_at` (see "Packed columns" above). `kernel_options`
    (block_t, block_c, num_warps) tune the Pallas kernel; the XLA reference ignores them."""
    C = weight.shape[0]
    _check_columns(x, C, x_offset, split_at)
    _check(C, weight, bias)
    _check_activation(activation)
    S = cu_seqlens.shape[0] - 1
    K = weight.shape[1]
    if initial_states is not None and initial_states.shape != (S, C, K - 1):
        raise ValueError(f"initial_states must be {(S, C, K - 1)}, got {initial_states.shape}")
    which = resolve_impl(impl, interpret, pallas_problem(K), "causal_conv1d")
    if which == "xla":
        y, final_states = causal_conv1d_xla(x[:, x_offset:x_offset + C], weight, bias, cu_seqlens=cu_seqlens,
                                            initial_states=initial_states, activation=activation)
        return _split_output(y, split_at), final_states
    from pallas_kernels.causal_conv1d_pallas import causal_conv1d_pallas

    return causal_conv1d_pallas(x, weight, bias, cu_seqlens=cu_seqlens, initial_states=initial_states,
                                activation=activation, x_offset=x_offset, split_at=split_at, interpret=interpret,
                                **kernel_options)


def causal_conv1d_pooled_xla(x, weight, bias, *, cu_seqlens, conv_pool, slot_ids, has_initial_state,
                             activation="silu"):
    """The reference on pool rows: gather the initial states, convolve, scatter the finals back (rows as in
    `packing.pool_rows`)."""
    read_rows, write_rows = pool_rows(cu_seqlens, slot_ids, has_initial_state, conv_pool.shape[0])
    initial_states = conv_pool.at[read_rows].get(mode="fill", fill_value=0)
    y, final_states = causal_conv1d_xla(x, weight, bias, cu_seqlens=cu_seqlens, initial_states=initial_states,
                                        activation=activation)
    return y, conv_pool.at[write_rows].set(final_states.astype(conv_pool.dtype), mode="drop")


def causal_conv1d_pooled(x, weight, bias, *, cu_seqlens, conv_pool, slot_ids, has_initial_state, activation="silu",
                         x_offset=0, split_at=None, impl="auto", interpret=False, **kernel_options):
    """`causal_conv1d` with the conv states in the slot pool: conv_pool[slots, C, K-1], slot_ids int32[S],
    has_initial_state bool[S] -> (y[T, C], conv_pool). Sequence s starts from conv_pool[slot_ids[s]] where
    has_initial_state[s] (else from zeros) and leaves its final state there; empty sequences (padding rows) touch
    nothing. Donate the pool to update it in place. `x_offset` and `split_at` as in `causal_conv1d`.
    `kernel_options` (block_t, block_c, num_warps) tune the Pallas kernel; the XLA reference ignores them."""
    C = weight.shape[0]
    _check_columns(x, C, x_offset, split_at)
    _check(C, weight, bias)
    _check_activation(activation)
    if conv_pool.ndim != 3 or conv_pool.shape[1:] != (C, weight.shape[1] - 1):
        raise ValueError(f"conv_pool must be [slots, {C}, {weight.shape[1] - 1}], got {conv_pool.shape}")
    check_pool_index(cu_seqlens.shape[0] - 1, slot_ids, has_initial_state)
    which = resolve_impl(impl, interpret, pallas_problem(weight.shape[1]), "causal_conv1d_pooled")
    if which == "xla":
        y, conv_pool = causal_conv1d_pooled_xla(x[:, x_offset:x_offset + C], weight, bias, cu_seqlens=cu_seqlens,
                                                conv_pool=conv_pool, slot_ids=slot_ids,
                                                has_initial_state=has_initial_state, activation=activation)
        return _split_output(y, split_at), conv_pool
    from pallas_kernels.causal_conv1d_pallas import causal_conv1d_pooled_pallas

    return causal_conv1d_pooled_pallas(x, weight, bias, cu_seqlens=cu_seqlens, conv_pool=conv_pool,
                                       slot_ids=slot_ids, has_initial_state=has_initial_state, activation=activation,
                                       x_offset=x_offset, split_at=split_at, interpret=interpret, **kernel_options)


def causal_conv1d_update(x, conv_state, weight, bias, *, slot_ids, activation="silu", x_offset=0, impl="auto",
                         interpret=False):
    """Decode step: x[B,C], conv_state[slots,C,K-1] -> (y[B,C], conv_state), through slot_ids[B].

    x may be wider than the conv: its columns x_offset .. x_offset + C are the input (C = weight.shape[0]), so a
    packed projection goes in whole; on the GPU a slice of it would be a copy kernel of its own.
    """
    C = weight.shape[0]
    _check_columns(x, C, x_offset)
    _check(C, weight, bias)
    _check_activation(activation)
    if conv_state.shape[1:] != (C, weight.shape[1] - 1):
        raise ValueError(f"conv_state must be [slots, {C}, {weight.shape[1] - 1}], got {conv_state.shape}")
    which = resolve_impl(impl, interpret, pallas_problem(weight.shape[1]), "causal_conv1d_update")
    if which == "xla":
        return causal_conv1d_update_xla(x[:, x_offset:x_offset + C], conv_state, weight, bias, slot_ids=slot_ids,
                                        activation=activation)
    from pallas_kernels.causal_conv1d_pallas import causal_conv1d_update_pallas

    return causal_conv1d_update_pallas(x, conv_state, weight, bias, slot_ids=slot_ids, activation=activation,
                                       x_offset=x_offset, interpret=interpret)
