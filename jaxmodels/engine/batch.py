"""Host-side batch metadata, padded to a bucket: numpy arrays with the exact dtypes the executables were compiled
for. Padding rows point at slot 0 and page 0 and sample greedily."""

import numpy as np


def _page_rows(requests, rows: int, pages_per_seq: int) -> np.ndarray:
    table = np.zeros((rows, pages_per_seq), np.int32)
    for i, request in enumerate(requests):
        table[i, : len(request.pages)] = request.pages
    return table


def _sampling(requests, rows: int) -> dict:
    out = {
        "temperature": np.zeros(rows, np.float32),
        "top_p": np.ones(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "seed": np.zeros(rows, np.uint32),
        "step": np.zeros(rows, np.int32),
    }
    for i, r in enumerate(requests):
        p = r.params
        out["temperature"][i], out["top_p"][i], out["top_k"][i] = p.temperature, p.top_p, max(p.top_k, 0)
        out["seed"][i], out["step"][i] = r.seed, len(r.output)
    return out


def extend_batch(chunks, num_tokens: int, num_seqs: int, pages_per_seq: int) -> dict:
    """chunks: [(request, start, length)] -> the extend step's batch, num_tokens / num_seqs rows."""
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    slot_ids = np.zeros(num_seqs, np.int32)
    prompt_lens = np.zeros(num_seqs, np.int32)
    has_prefix = np.zeros(num_seqs, bool)
    offset = 0
    for i, (request, start, length) in enumerate(chunks):
        tokens[offset: offset + length] = request.token_ids[start: start + length]
        positions[offset: offset + length] = np.arange(start, start + length)
        offset += length
        cu[i + 1] = offset
        slot_ids[i], prompt_lens[i], has_prefix[i] = request.slot, len(request.prompt), start > 0
    cu[len(chunks) + 1:] = offset  # padded sequences are empty
    requests = [c[0] for c in chunks]
    return dict(tokens=tokens, positions=positions, cu_seqlens=cu, slot_ids=slot_ids, prompt_lens=prompt_lens,
                has_prefix=has_prefix, page_table=_page_rows(requests, num_seqs, pages_per_seq),
                **_sampling(requests, num_seqs))


def decode_batch(requests, rows: int, pages_per_seq: int) -> dict:
    tokens = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    slot_ids = np.zeros(rows, np.int32)
    for i, r in enumerate(requests):
        tokens[i], positions[i], slot_ids[i] = r.token_ids[-1], r.num_computed, r.slot
    return dict(tokens=tokens, positions=positions, slot_ids=slot_ids,
                page_table=_page_rows(requests, rows, pages_per_seq), **_sampling(requests, rows))
