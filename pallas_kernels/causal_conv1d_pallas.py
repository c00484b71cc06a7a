"""Pallas (Triton) kernels of the packed causal conv1d and its decode step; semantics in `causal_conv1d`.

Prefill: the token axis is cut into blocks aligned to sequence starts (the same table as the SSD scan,
`packing.aligned_blocks`), so one program = (channel block, token block of one sequence) and a single long sequence
still spreads over many programs. The K shifted input tiles are K overlapping loads of x (the overlap hits L1/L2).
Only a sequence's first block reads its initial state, on the first K-1 rows: those rows are static, so the init
values are selected in with `where` instead of a gather. Extra programs, one per sequence, write the final states
(the last K-1 inputs, reaching into the initial state for short sequences) and zero the bucket-padding tail.

Interpret mode (CPU) clamps out-of-bounds dynamic slices at the start of an array instead of masking them, so there
the wrapper prepends K-1 zero rows to x and the kernel offsets its row indices; on the GPU negative rows are only
ever touched under a false mask, and nothing is copied.

Decode: one program per (request, channel block) loads the K-1 state columns of its slot, x and the weights, and
writes the shifted state back in place (input_output_aliases). Slot 0 rules as in `causal_conv1d`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dispatch import next_pow2
from pallas_kernels.packing import aligned_blocks, for_each_padding_block

_f32 = jnp.float32
# Static column indices are passed as jnp.int32: interpret mode's load rule needs array-typed scalar indices.


def _act(v, activation):
    if activation is None:
        return v
    return v / (1.0 + jnp.exp(-v))


def _conv_kernel(bseq_ref, bstart_ref, blen_ref, cu_ref, x_ref, w_ref, bias_ref, *rest, NB, S, T, C, K, BT, BC,
                 has_init, activation, row_base):
    if has_init:
        init_ref, y_ref, fin_ref = rest
    else:
        y_ref, fin_ref = rest
    c0 = pl.program_id(0) * BC
    j = pl.program_id(1)
    cmask = (c0 + lax.broadcasted_iota(jnp.int32, (BC,), 0)) < C
    rows = lax.broadcasted_iota(jnp.int32, (BT,), 0)

    # Blocks past the real ones (the bound counts one spare per sequence) have length 0 and do nothing.
    @pl.when((j < NB) & (blen_ref[jnp.minimum(j, NB - 1)] > 0))
    def _conv_block():
        s = bseq_ref[j]
        t0 = bstart_ref[j]
        length = blen_ref[j]
        base_off = t0 - cu_ref[s]  # offset of the block's first token inside its sequence
        first = base_off == 0
        rmask = rows < length
        acc = jnp.zeros((BT, BC), _f32) + plgpu.load(bias_ref.at[pl.ds(c0, BC)], mask=cmask, other=0.0).astype(
            _f32)[None, :]
        if has_init:
            init_cols = [plgpu.load(init_ref.at[s, pl.ds(c0, BC), jnp.int32(i)], mask=cmask & first,
                                    other=0.0).astype(_f32) for i in range(K - 1)]
        for k in range(K):
            shift = K - 1 - k
            inside = rmask & (base_off + rows >= shift)
            xs = plgpu.load(x_ref.at[pl.ds(row_base + t0 - shift, BT), pl.ds(c0, BC)],
                            mask=inside[:, None] & cmask[None, :], other=0.0).astype(_f32)
            if has_init:
                # Row r < shift of a sequence's first block reads init column K-1 + r - shift.
                for r in range(min(shift, BT)):
                    xs = jnp.where(((rows == r) & first)[:, None], init_cols[K - 1 + r - shift][None, :], xs)
            w = plgpu.load(w_ref.at[pl.ds(c0, BC), jnp.int32(k)], mask=cmask, other=0.0).astype(_f32)
            acc = acc + xs * w[None, :]
        plgpu.store(y_ref.at[pl.ds(row_base + t0, BT), pl.ds(c0, BC)], _act(acc, activation).astype(y_ref.dtype),
                    mask=rmask[:, None] & cmask[None, :])

    @pl.when(j >= NB)
    def _final_states():
        s = j - NB
        start = cu_ref[s]
        length = cu_ref[s + 1] - start
        for i in range(K - 1):
            u = length - (K - 1) + i  # position in the sequence of final-state column i (< 0: initial state)
            v = plgpu.load(x_ref.at[row_base + start + u, pl.ds(c0, BC)], mask=cmask & (u >= 0), other=0.0)
            if has_init:
                vi = plgpu.load(init_ref.at[s, pl.ds(c0, BC), jnp.clip(length + i, 0, K - 2)],
                                mask=cmask & (u < 0), other=0.0)
                v = jnp.where(u >= 0, v.astype(fin_ref.dtype), vi.astype(fin_ref.dtype))
            plgpu.store(fin_ref.at[s, pl.ds(c0, BC), jnp.int32(i)], v.astype(fin_ref.dtype), mask=cmask)

        @pl.when(s == S - 1)
        def _zero_tail():
            zeros = jnp.zeros((BT, BC), y_ref.dtype)

            def zero_block(t):
                plgpu.store(y_ref.at[pl.ds(row_base + t, BT), pl.ds(c0, BC)], zeros,
                            mask=(rows < (T - t))[:, None] & cmask[None, :])

            for_each_padding_block(cu_ref, T, BT, zero_block)


@functools.partial(jax.jit, static_argnames=("activation", "block_t", "block_c", "num_warps", "interpret"))
def _conv_pallas(x, weight, bias, cu_seqlens, initial_states, *, activation, block_t, block_c, num_warps,
                 interpret):
    T, C = x.shape
    K = weight.shape[1]
    S = cu_seqlens.shape[0] - 1
    tab = aligned_blocks(cu_seqlens, T, block_t)
    NB = tab["seq"].shape[0]
    row_base = K - 1 if interpret else 0
    if row_base:
        x = jnp.concatenate([jnp.zeros((row_base, C), x.dtype), x], axis=0)
    has_init = initial_states is not None
    fin_dtype = initial_states.dtype if has_init else x.dtype
    kernel = functools.partial(_conv_kernel, NB=NB, S=S, T=T, C=C, K=K, BT=block_t, BC=block_c,
                               has_init=has_init, activation=activation, row_base=row_base)
    args = [tab["seq"], tab["start"], tab["length"], cu_seqlens.astype(jnp.int32), x, weight,
            jnp.zeros((C,), _f32) if bias is None else bias]
    if has_init:
        args.append(initial_states)
    y, fin = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(C, block_c), NB + S),
        out_shape=(jax.ShapeDtypeStruct((T + row_base, C), x.dtype), jax.ShapeDtypeStruct((S, C, K - 1), fin_dtype)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d",
    )(*args)
    return y[row_base:], fin


def causal_conv1d_pallas(x, weight, bias, *, cu_seqlens, initial_states=None, activation="silu", interpret=False,
                         block_t=64, block_c=256, num_warps=4):
    if weight.shape[1] < 2:
        raise ValueError("the conv kernel needs K >= 2")
    block_c = min(block_c, max(16, next_pow2(x.shape[1])))
    return _conv_pallas(x, weight, bias, cu_seqlens, initial_states, activation=activation, block_t=block_t,
                        block_c=block_c, num_warps=num_warps, interpret=interpret)


def _update_kernel(slot_ref, x_ref, w_ref, bias_ref, state_in_ref, y_ref, state_ref, *, C, K, BC, activation, x_off):
    del state_in_ref  # aliased to state_ref
    b = pl.program_id(0)
    c0 = pl.program_id(1) * BC
    cmask = (c0 + lax.broadcasted_iota(jnp.int32, (BC,), 0)) < C
    slot = slot_ref[b]
    x = plgpu.load(x_ref.at[b, pl.ds(x_off + c0, BC)], mask=cmask, other=0.0)
    cols = [plgpu.load(state_ref.at[slot, pl.ds(c0, BC), jnp.int32(i)], mask=cmask, other=0.0)
            for i in range(K - 1)]
    window = cols + [x.astype(state_ref.dtype)]  # the new input rounded to the state dtype, as it will be stored
    acc = plgpu.load(bias_ref.at[pl.ds(c0, BC)], mask=cmask, other=0.0).astype(_f32)
    for k in range(K):
        w = plgpu.load(w_ref.at[pl.ds(c0, BC), jnp.int32(k)], mask=cmask, other=0.0).astype(_f32)
        acc = acc + (window[k].astype(_f32) if k < K - 1 else x.astype(_f32)) * w
    plgpu.store(y_ref.at[b, pl.ds(c0, BC)], _act(acc, activation).astype(y_ref.dtype), mask=cmask)
    for i in range(K - 1):
        plgpu.store(state_ref.at[slot, pl.ds(c0, BC), jnp.int32(i)], window[i + 1], mask=cmask)


@functools.partial(jax.jit, static_argnames=("activation", "x_offset", "block_c", "num_warps", "interpret"))
def _update_pallas(x, conv_state, weight, bias, slot_ids, *, activation, x_offset, block_c, num_warps, interpret):
    Bsz = x.shape[0]
    C, K = weight.shape
    kernel = functools.partial(_update_kernel, C=C, K=K, BC=block_c, activation=activation, x_off=x_offset)
    return pl.pallas_call(
        kernel,
        grid=(Bsz, pl.cdiv(C, block_c)),
        out_shape=(jax.ShapeDtypeStruct((Bsz, C), x.dtype), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)),
        input_output_aliases={4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_update",
    )(slot_ids.astype(jnp.int32), x, weight, jnp.zeros((C,), _f32) if bias is None else bias, conv_state)


def causal_conv1d_update_pallas(x, conv_state, weight, bias, *, slot_ids, activation="silu", x_offset=0,
                                interpret=False, block_c=256, num_warps=4):
    """x[B, >= x_offset + C]: the conv's input is its columns x_offset .. x_offset + C (C = weight.shape[0])."""
    if weight.shape[1] < 2:
        raise ValueError("the conv kernel needs K >= 2")
    block_c = min(block_c, max(16, next_pow2(weight.shape[0])))
    return _update_pallas(x, conv_state, weight, bias, slot_ids, activation=activation, x_offset=x_offset,
                          block_c=block_c, num_warps=num_warps, interpret=interpret)
