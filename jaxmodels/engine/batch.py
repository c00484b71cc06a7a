"""Host-side batch metadata, padded to a bucket: numpy arrays with the exact dtypes the executables were compiled
for, gathered from the scheduler's per-slot tables (no per-row Python beyond reading each request's slot and
position). Padding rows point at slot 0, whose table rows are zeros: page 0, greedy sampling.

A decode batch carries no tokens: each row's input is the token its request sampled last, which the device keeps
per slot (`last_tokens`), so a step can be sent before the previous one's tokens have reached the host.
"""

import numpy as np

# What the sampler reads of a batch (the forward reads the rest, slot ids included).
SAMPLING_KEYS = ("slot_ids", "temperature", "top_p", "top_k", "seed", "step")


def _sampling(tables, slot_ids: np.ndarray, ends: np.ndarray) -> dict:
    """Per-row sampling knobs; `step` (the index of the output token being drawn, which seeds its randomness) is
    the row's end position minus its prompt length."""
    return dict(temperature=tables.temperature[slot_ids], top_p=tables.top_p[slot_ids],
                top_k=tables.top_k[slot_ids], seed=tables.seed[slot_ids],
                step=(ends - tables.prompt_len[slot_ids]).astype(np.int32))


def extend_batch(chunks, num_tokens: int, num_seqs: int, tables) -> dict:
    """chunks: [(request, start, length)] -> the extend step's batch, num_tokens / num_seqs rows."""
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    slot_ids = np.zeros(num_seqs, np.int32)
    has_prefix = np.zeros(num_seqs, bool)
    ends = np.zeros(num_seqs, np.int32)
    offset = 0
    for i, (request, start, length) in enumerate(chunks):
        tokens[offset: offset + length] = request.token_ids[start: start + length]
        positions[offset: offset + length] = np.arange(start, start + length)
        offset += length
        cu[i + 1] = offset
        slot_ids[i], has_prefix[i], ends[i] = request.slot, start > 0, start + length
    cu[len(chunks) + 1:] = offset  # padded sequences are empty
    return dict(tokens=tokens, positions=positions, cu_seqlens=cu, slot_ids=slot_ids,
                prompt_lens=tables.prompt_len[slot_ids], has_prefix=has_prefix,
                page_table=tables.page_table[slot_ids], **_sampling(tables, slot_ids, ends))


def decode_batch(requests, rows: int, tables) -> dict:
    """requests: the decode step's requests, their num_computed already counting this step's token."""
    slot_ids = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    n = len(requests)
    slot_ids[:n] = np.fromiter((r.slot for r in requests), np.int32, n)
    positions[:n] = np.fromiter((r.num_computed - 1 for r in requests), np.int32, n)
    return dict(positions=positions, slot_ids=slot_ids, page_table=tables.page_table[slot_ids],
                **_sampling(tables, slot_ids, positions + 1))
