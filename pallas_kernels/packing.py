"""Packed variable-length batches: which sequence each packed token belongs to, and blocks aligned to sequence starts.

`cu_seqlens` int32[S+1] are the sequences' boundaries in the packing (sequence s owns tokens cu[s] .. cu[s+1]-1;
tokens from cu[S] on are padding).

Two conventions for the sequence of a padding token, each for its use: `token_sequence_ids` gives it S, one past the
last sequence (an index into arrays with a spare row for padding, like the engine's page table with its null row;
`id < S` tells real tokens); `token_sequences` clamps it to S - 1, for gathering from arrays of exactly S rows, and
returns the real-token mask beside it so that what padding tokens compute from the last sequence's rows is dropped.

Nothing here may lower to an XLA loop, since these run inside every engine step. `jnp.searchsorted`'s default is an
XLA while loop, and on the GPU each iteration of an XLA while loop (like each XLA conditional) copies its predicate
to the host and waits for it: the thread that launches a step blocks until the device has caught up, and host and
device work cannot overlap. So positions are found by comparing against all boundaries (O(T * S): a few million
compares at most), and prefix sums go through `prefix_sum`: from jax 0.11 on, `jnp.cumsum` lowers on the GPU to a
`chlo.scan`, whose portable form is a while loop over the elements. The one loop here, `for_each_padding_block`,
is for Pallas kernel bodies, which lower to Triton and not to XLA.
"""

import jax.numpy as jnp
from jax import lax


SHORT_PREFIX_SUM = 1024  # longest integer vector summed as one masked reduction


def prefix_sum(x, axis: int = 0):
    """Inclusive prefix sum along `axis`, without a loop on any jax version.

    A short integer vector (the per-expert and per-sequence counts of the step programs' schedules) is summed as one
    masked reduction, out[i] = sum(x[j] for j <= i): n² adds, but one fused kernel, where the log-depth tree of
    slices and adds that everything else takes is a kernel per level on the GPU, each a node of the step's graph.
    Integer sums are exact in any order, so both forms give the same values."""
    n = x.shape[axis]
    if x.ndim == 1 and jnp.issubdtype(x.dtype, jnp.integer) and n <= SHORT_PREFIX_SUM:
        j = jnp.arange(n)
        return jnp.sum(jnp.where(j[None, :] <= j[:, None], x[None, :], 0), axis=1, dtype=x.dtype)
    return lax.associative_scan(jnp.add, x, axis=axis)


def count_at_or_below(boundaries, values):
    """For each value, how many boundaries are <= it (= searchsorted(boundaries, values, side="right") for sorted
    boundaries), without a loop."""
    return jnp.sum(boundaries[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def token_sequence_ids(cu_seqlens, num_tokens: int):
    """int32[T]: the sequence of each packed token; S (one past the last sequence) for padding tokens, so `ids < S`
    marks the real ones. To index arrays of exactly S rows, clamp (`token_sequences` does, with that mask)."""
    cu = cu_seqlens.astype(jnp.int32)
    return count_at_or_below(cu[1:], jnp.arange(num_tokens, dtype=jnp.int32))


def token_sequences(cu_seqlens, num_tokens: int):
    """(seq, offset, real), int32[T], int32[T], bool[T]: each packed token's sequence, for indexing arrays of S rows.

    real[t] = t < cu[S]. seq[t] is `token_sequence_ids` clamped to S - 1: a padding token gets the last sequence,
    and whatever it computes from that sequence's rows must be masked with `real`. offset[t] = t - cu[seq[t]], the
    token's index within its sequence's span of this packing (past that span's end for a padding token); it is not
    the token's position in its request, which in a chunked prefill does not start at 0.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    ids = token_sequence_ids(cu, num_tokens)
    seq = jnp.minimum(ids, num_seqs - 1)
    return seq, jnp.arange(num_tokens, dtype=jnp.int32) - cu[seq], ids < num_seqs


def num_blocks_bound(num_tokens: int, num_seqs: int, block: int) -> int:
    """Static bound on the count of blocks aligned to sequence starts: sum_s ceil(n_s / L) <= T // L + S."""
    return max((num_tokens + num_seqs * (block - 1)) // block, 1)


def aligned_blocks(cu_seqlens, num_tokens: int, block: int) -> dict:
    """Blocks of at most `block` tokens that never straddle two sequences: sequence s of length n_s owns
    ceil(n_s / block) blocks, the last one possibly short.

    Returns int32 / bool arrays of the static length NB = num_blocks_bound(T, S, block): seq[b], start[b] (first
    token), length[b] (0 for the unused tail), first[b] / last[b] (the block opens / closes its sequence), and per
    sequence block_begin[s] (index of its first block) and nblocks[s].
    """
    cu = cu_seqlens.astype(jnp.int32)
    num_seqs = cu.shape[0] - 1
    nb = num_blocks_bound(num_tokens, num_seqs, block)
    nblocks = (cu[1:] - cu[:-1] + (block - 1)) // block
    block_cum = jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_sum(nblocks).astype(jnp.int32)])
    b = jnp.arange(nb, dtype=jnp.int32)
    # First sequence whose block range ends after b; empty sequences own no block and are skipped.
    seq = count_at_or_below(block_cum[1:], b)
    used = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    k = b - block_cum[seq]
    start = cu[seq] + k * block
    return dict(
        seq=seq,
        start=jnp.where(used, start, 0),
        length=jnp.where(used, jnp.clip(cu[seq + 1] - start, 0, block), 0),
        first=used & (k == 0),
        last=used & (k == nblocks[seq] - 1),
        block_begin=block_cum[:-1],
        nblocks=nblocks,
    )


def for_each_padding_block(cu_ref, num_tokens: int, block: int, body) -> None:
    """Inside a Pallas kernel: body(t0) for t0 = cu[S], cu[S] + block, ... below num_tokens, the blocks of bucket
    padding that a kernel zeroes; the last block may run past num_tokens, so `body` masks its rows.

    Kernel bodies only: there the loop is a Triton loop, where elsewhere it would be the XLA while loop this module
    keeps out of the step programs.
    """
    padding_start = cu_ref[cu_ref.shape[0] - 1]

    def step(i, carry):
        body(padding_start + i * block)
        return carry

    lax.fori_loop(0, (num_tokens - padding_start + (block - 1)) // block, step, 0)


def check_pool_index(num_seqs: int, slot_ids, has_initial_state) -> None:
    """The pooled kernels' per-sequence index: slot_ids and has_initial_state, one entry per sequence row."""
    if slot_ids.shape != (num_seqs,) or has_initial_state.shape != (num_seqs,):
        raise ValueError(f"slot_ids and has_initial_state must be [S]={num_seqs}, got {slot_ids.shape} and "
                         f"{has_initial_state.shape}")


def pool_rows(cu_seqlens, slot_ids, has_initial_state, num_slots: int):
    """(read_rows, write_rows) int32[S] of the pooled kernels' XLA references: the pool row each sequence reads its
    initial state from and writes its final state to, or the out-of-range row num_slots where it must not touch the
    pool. Fresh and empty sequences read nothing (gather with mode="fill" gives zeros) and empty ones, the bucket's
    padding rows (several on the null slot), write nothing (scatter with mode="drop"), so the null slot and idle
    slots never enter a result, whatever they hold."""
    cu = cu_seqlens.astype(jnp.int32)
    live = cu[1:] > cu[:-1]
    read_rows = jnp.where(live & has_initial_state.astype(bool), slot_ids, num_slots)
    return read_rows, jnp.where(live, slot_ids, num_slots)

