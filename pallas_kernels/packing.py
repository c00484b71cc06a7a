"""Packed variable-length batches: which sequence each packed token belongs to, and blocks aligned to sequence starts.

`cu_seqlens` int32[S+1] are the sequences' boundaries in the packing (sequence s owns tokens cu[s] .. cu[s+1]-1;
tokens from cu[S] on are padding).

Nothing here may lower to an XLA loop, since these run inside every engine step. `jnp.searchsorted`'s default is an
XLA while loop, and on the GPU each iteration of an XLA while loop (like each XLA conditional) copies its predicate
to the host and waits for it: the thread that launches a step blocks until the device has caught up, and host and
device work cannot overlap. So positions are found by comparing against all boundaries (O(T * S): a few million
compares at most), and prefix sums go through `prefix_sum`: from jax 0.11 on, `jnp.cumsum` lowers on the GPU to a
`chlo.scan`, whose portable form is a while loop over the elements.
"""

import jax.numpy as jnp
from jax import lax


def prefix_sum(x, axis: int = 0):
    """Inclusive prefix sum along `axis`, as a log-depth tree of slices and adds (no loop on any jax version)."""
    return lax.associative_scan(jnp.add, x, axis=axis)


def count_at_or_below(boundaries, values):
    """For each value, how many boundaries are <= it (= searchsorted(boundaries, values, side="right") for sorted
    boundaries), without a loop."""
    return jnp.sum(boundaries[None, :] <= values[:, None], axis=1, dtype=jnp.int32)


def token_sequence_ids(cu_seqlens, num_tokens: int):
    """int32[T]: the sequence of each packed token; S (one past the last sequence) for padding tokens."""
    cu = cu_seqlens.astype(jnp.int32)
    return count_at_or_below(cu[1:], jnp.arange(num_tokens, dtype=jnp.int32))


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
