"""Pallas (Triton) kernels of the packed causal conv1d and its decode step; semantics in `causal_conv1d`.

Prefill: the token axis is cut into blocks aligned to sequence starts (the same table as the SSD scan,
`packing.aligned_blocks`), so one program = (channel block, token block of one sequence) and a single long sequence
still spreads over many programs. The K shifted input tiles are K overlapping loads of x (the overlap hits L1/L2).
Only a sequence's first block reads its initial state, on the first K-1 rows: those rows are static, so the init
values are selected in with `where` instead of a gather. The same program writes the sequence's final state (the
last K-1 inputs, reaching into the initial state for short sequences), and one more program per channel block zeroes
the bucket-padding tail.

Pooled (the engine's extend step): the states live in the slot pool [slots, C, K-1], read and written in place
(input_output_aliases), sequence s at slot_ids[s], its initial state read only where has_initial_state[s]. Empty
sequences (bucket padding rows, several on the null slot) own no block and so touch nothing: no gather of the padding
rows' states before the kernel and no scatter of them after, which cost more than the conv itself at one real row of
256 (2026-12-02, Nano-9B's 8k prefill in 2048-token chunks: conv 19.3 ms and the state scatter 11.6 ms).

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


def _conv_kernel(bseq_ref, bstart_ref, blen_ref, cu_ref, x_ref, w_ref, bias_ref, *rest, NB, T, C, K, BT, BC, states,
                 activation, row_base, x_off, split_at):
    """`states`: "zeros" (no initial states), "given" (init_ref [S, C, K-1] in, fin_ref out) or "pooled" (read from
    and written to pool_ref[slot_ids[s]] in place, the initial state only where has_initial_state[s]). The input is
    x's columns x_off .. x_off + C; with `split_at` the output is two arrays, columns below it and from it on (BC
    divides split_at, so a program writes to one of them)."""
    if states == "pooled":
        slot_ref, flag_ref, _, *y_refs, pool_ref = rest  # the pool input is aliased to pool_ref
    elif states == "given":
        init_ref, *y_refs, fin_ref = rest
    else:
        *y_refs, fin_ref = rest
    assert len(y_refs) == (2 if split_at else 1)
    c0 = pl.program_id(0) * BC
    j = pl.program_id(1)
    cmask = (c0 + lax.broadcasted_iota(jnp.int32, (BC,), 0)) < C
    rows = lax.broadcasted_iota(jnp.int32, (BT,), 0)

    def initial_column(s, i):
        if states == "pooled":
            return pool_ref.at[slot_ref[s], pl.ds(c0, BC), jnp.int32(i)]
        return init_ref.at[s, pl.ds(c0, BC), jnp.int32(i)]

    def store_y(t, value, mask):
        """y rows t .. t + BT of this program's channels, into the output array that holds them."""
        if not split_at:
            plgpu.store(y_refs[0].at[pl.ds(row_base + t, BT), pl.ds(c0, BC)], value, mask=mask)
            return
        for ref, lo, hi in ((y_refs[0], 0, split_at), (y_refs[1], split_at, C)):
            @pl.when((c0 >= lo) & (c0 < hi))
            def _store():
                plgpu.store(ref.at[pl.ds(row_base + t, BT), pl.ds(c0 - lo, BC)], value, mask=mask)

    def final_column(s, i):
        if states == "pooled":
            return pool_ref.at[slot_ref[s], pl.ds(c0, BC), jnp.int32(i)]
        return fin_ref.at[s, pl.ds(c0, BC), jnp.int32(i)]

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
        init_cols = [jnp.zeros((BC,), _f32)] * (K - 1)
        if states != "zeros":
            read = cmask & first & ((flag_ref[s] != 0) if states == "pooled" else True)
            init_cols = [plgpu.load(initial_column(s, i), mask=read, other=0.0).astype(_f32) for i in range(K - 1)]
        for k in range(K):
            shift = K - 1 - k
            inside = rmask & (base_off + rows >= shift)
            xs = plgpu.load(x_ref.at[pl.ds(row_base + t0 - shift, BT), pl.ds(x_off + c0, BC)],
                            mask=inside[:, None] & cmask[None, :], other=0.0).astype(_f32)
            if states != "zeros":
                # Row r < shift of a sequence's first block reads init column K-1 + r - shift.
                for r in range(min(shift, BT)):
                    xs = jnp.where(((rows == r) & first)[:, None], init_cols[K - 1 + r - shift][None, :], xs)
            w = plgpu.load(w_ref.at[pl.ds(c0, BC), jnp.int32(k)], mask=cmask, other=0.0).astype(_f32)
            acc = acc + xs * w[None, :]
        store_y(t0, _act(acc, activation).astype(y_refs[0].dtype), rmask[:, None] & cmask[None, :])
        # The sequence's first block also writes its final state: the last K-1 inputs of init ++ x[seq], reaching
        # into the initial state for a sequence shorter than K-1. The same program read that initial state above,
        # with the same [BC] layout, so each thread reads a column before it overwrites it in the pool.
        seq_start, seq_len = cu_ref[s], cu_ref[s + 1] - cu_ref[s]
        for i in range(K - 1):
            u = seq_len - (K - 1) + i  # position in the sequence of final column i (< 0: init column seq_len + i)
            v = plgpu.load(x_ref.at[row_base + seq_start + u, pl.ds(x_off + c0, BC)], mask=cmask & first & (u >= 0),
                           other=0.0).astype(_f32)
            for col in range(K - 1):
                v = jnp.where((u < 0) & (seq_len + i == col), init_cols[col], v)
            out = final_column(s, i)
            plgpu.store(out, v.astype(out.dtype), mask=cmask & first)

    @pl.when(j == NB)  # tokens past cu[-1] (bucket padding) belong to no sequence: y = 0
    def _zero_tail():
        zeros = jnp.zeros((BT, BC), y_refs[0].dtype)

        def zero_block(t):
            store_y(t, zeros, (rows < (T - t))[:, None] & cmask[None, :])

        for_each_padding_block(cu_ref, T, BT, zero_block)


@functools.partial(jax.jit, static_argnames=("activation", "x_offset", "split_at", "block_t", "block_c", "num_warps",
                                             "interpret"))
def _conv_pallas(x, weight, bias, cu_seqlens, initial_states, pool_index, *, activation, x_offset, split_at, block_t,
                 block_c, num_warps, interpret):
    """Without `pool_index`: `initial_states` None or [S, C, K-1] -> (y, final states [S, C, K-1]). With
    `pool_index` = (slot_ids, has_initial_state), `initial_states` is the slot pool -> (y, the pool updated in
    place). x's columns x_offset .. x_offset + C are the input; with `split_at`, y is (y[:, :split_at],
    y[:, split_at:]) as two arrays."""
    _check_kernel_size(weight)
    T = x.shape[0]
    C, K = weight.shape
    block_c = min(block_c, max(16, next_pow2(C)))
    if split_at:  # a channel block on each side of the split, never across it
        block_c = min(block_c, split_at & -split_at)
    S = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    tab = aligned_blocks(cu, T, block_t)
    NB = tab["seq"].shape[0]
    row_base = K - 1 if interpret else 0
    if row_base:
        x = jnp.concatenate([jnp.zeros((row_base, x.shape[1]), x.dtype), x], axis=0)
    states = "pooled" if pool_index is not None else "given" if initial_states is not None else "zeros"
    kernel = functools.partial(_conv_kernel, NB=NB, T=T, C=C, K=K, BT=block_t, BC=block_c, states=states,
                               activation=activation, row_base=row_base, x_off=x_offset, split_at=split_at)
    args = [tab["seq"], tab["start"], tab["length"], cu, x, weight, jnp.zeros((C,), _f32) if bias is None else bias]
    if states == "pooled":
        args += [*(a.astype(jnp.int32) for a in pool_index), initial_states]
        fin_shape = jax.ShapeDtypeStruct(initial_states.shape, initial_states.dtype)
        aliases = {len(args) - 1: 2 if split_at else 1}
    else:
        fin_dtype = initial_states.dtype if states == "given" else x.dtype
        fin_shape, aliases = jax.ShapeDtypeStruct((S, C, K - 1), fin_dtype), {}
        if states == "given":
            args.append(initial_states)
    widths = (split_at, C - split_at) if split_at else (C,)
    *ys, fin = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(C, block_c), NB + 1),
        out_shape=(*(jax.ShapeDtypeStruct((T + row_base, w), x.dtype) for w in widths), fin_shape),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv1d_pooled" if states == "pooled" else "causal_conv1d",
    )(*args)
    if states != "pooled":
        # An empty sequence has no block, so no program wrote its final state: that is its initial state.
        empty = (cu[1:] == cu[:-1])[:, None, None]
        fin = jnp.where(empty, jnp.zeros((), fin.dtype) if initial_states is None else initial_states, fin)
    ys = tuple(y[row_base:] for y in ys)
    return (ys if split_at else ys[0]), fin


def _check_kernel_size(weight):
    if weight.shape[1] < 2:
        raise ValueError("the conv kernel needs K >= 2")


# Token x channel tile of the prefill conv. H200, Nano-9B's 12,288 channels, one 8192-token sequence, bf16
# (`bash bench/lab/h200_runs.sh conv_tune`, 2026-12-02): 32 x 128 (this default) 172 µs, 16 x 256 187, 32 x 256 282,
# 64 x 128 294, 16 x 512 316, 64 x 256 (the default before) 339; byte floor 95. Narrow tiles hold fewer registers a
# thread (the K shifted input tiles and the float32 sum), so more programs share an SM and more loads are in flight.
BLOCK_T, BLOCK_C = 32, 128


def causal_conv1d_pallas(x, weight, bias, *, cu_seqlens, initial_states=None, activation="silu", x_offset=0,
                         split_at=None, interpret=False, block_t=BLOCK_T, block_c=BLOCK_C, num_warps=4):
    return _conv_pallas(x, weight, bias, cu_seqlens, initial_states, None, activation=activation, x_offset=x_offset,
                        split_at=split_at, block_t=block_t, block_c=block_c, num_warps=num_warps, interpret=interpret)


def causal_conv1d_pooled_pallas(x, weight, bias, *, cu_seqlens, conv_pool, slot_ids, has_initial_state,
                                activation="silu", x_offset=0, split_at=None, interpret=False, block_t=BLOCK_T,
                                block_c=BLOCK_C, num_warps=4):
    """Kernel entry point of `causal_conv1d.causal_conv1d_pooled`: -> (y, conv_pool updated in place)."""
    return _conv_pallas(x, weight, bias, cu_seqlens, conv_pool, (slot_ids, has_initial_state), activation=activation,
                        x_offset=x_offset, split_at=split_at, block_t=block_t, block_c=block_c, num_warps=num_warps,
                        interpret=interpret)


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
    _check_kernel_size(weight)
    block_c = min(block_c, max(16, next_pow2(weight.shape[0])))
    return _update_pallas(x, conv_state, weight, bias, slot_ids, activation=activation, x_offset=x_offset,
                          block_c=block_c, num_warps=num_warps, interpret=interpret)
