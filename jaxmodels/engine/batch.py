"""Host-side batch metadata, padded to a bucket: numpy arrays with the exact dtypes the executables were compiled
for, gathered from the scheduler's per-slot tables (no per-row Python beyond reading each request's slot and
position). Padding rows point at slot 0, whose table rows are zeros: page 0, greedy sampling.

Each batch is a pytree dataclass the jitted step takes as is. A step's batch comes with the sampler's
`SamplingKnobs`, which go to the sampler executable, not to the forward.

A decode batch carries no tokens: each row's input is the token its request sampled last, which the device keeps
per slot (`last_tokens`), so a step can be sent before the previous one's tokens have reached the host.
"""

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExtendBatch:
    """Chunks of prompts packed back to back. T tokens (from cu_seqlens[-1] on: padding), S sequences (padded
    sequences are empty, with slot 0 and an all-zero page row)."""

    tokens: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T]
    cu_seqlens: np.ndarray  # int32[S+1]
    slot_ids: np.ndarray  # int32[S]
    prompt_lens: np.ndarray  # int32[S]
    has_prefix: np.ndarray  # bool[S]: the chunk continues a request (not its first)
    page_table: np.ndarray  # int32[S, pages_per_seq]
    # Prefix caching of a recurrent model (engine.prefix_cache), C copies each (C = 0 otherwise; padding: 0 -> 0,
    # the null slot): recurrent state copied from slot restore_from[i] to restore_to[i] before the step (a
    # request resuming from a cached prefix's snapshot, or an ended request's state stashed out of the slot a new
    # request takes; all read before any is written), and from save_from[i] to save_to[i] after it (a snapshot
    # saved where a chunk ends).
    restore_from: np.ndarray  # int32[C]
    restore_to: np.ndarray  # int32[C]
    save_from: np.ndarray  # int32[C]
    save_to: np.ndarray  # int32[C]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One token per row (B rows; padding rows: slot 0, position 0, an all-zero page row)."""

    positions: np.ndarray  # int32[B]
    slot_ids: np.ndarray  # int32[B]
    page_table: np.ndarray  # int32[B, pages_per_seq]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyBatch:
    """Speculative decoding's step: per row, its slot, whose last token, its position and the drafts after it are on
    the device (padding rows: slot 0, an all-zero page row)."""

    slot_ids: np.ndarray  # int32[B]
    prompt_lens: np.ndarray  # int32[B]
    page_table: np.ndarray  # int32[B, pages_per_seq]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingKnobs:
    """Per row of the logits: the slot its token is stored at, and how to draw it. `step` is the index of the
    output token being drawn, which seeds its randomness."""

    slot_ids: np.ndarray  # int32[R]
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seed: np.ndarray
    step: np.ndarray  # int32[R]

    @property
    def greedy(self) -> bool:
        return not np.any(self.temperature > 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdjustKnobs:
    """What the adjusting sampler (engine.sampler.sample_adjusted) reads besides SamplingKnobs, per row: the
    penalties, min_tokens, the (token, bias) entries (those of min_tokens' stop tokens flagged), and whether the
    row's token is one of its request's outputs (counted for the penalties; not for a chunk that leaves part of
    its prompt for later, nor for padding)."""

    presence: np.ndarray  # float32[R]
    frequency: np.ndarray  # float32[R]
    repetition: np.ndarray  # float32[R]
    min_tokens: np.ndarray  # int32[R]
    bias_ids: np.ndarray  # int32[R, BIAS_ENTRIES]
    bias: np.ndarray  # float32[R, BIAS_ENTRIES]
    bias_stops: np.ndarray  # bool[R, BIAS_ENTRIES]
    counted: np.ndarray  # bool[R]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenRecord:
    """The tokens an extend step's penalized requests compute, for the device's per-slot counts
    (engine.sampler.record_tokens): P entries (padding: slot 0), and the slots whose request starts over (its first
    chunk), whose counts are cleared first."""

    slots: np.ndarray  # int32[P]
    tokens: np.ndarray  # int32[P]
    is_output: np.ndarray  # bool[P]: an output token being recomputed (a prompt token otherwise)
    restarted: np.ndarray  # int32[S]


def adjust_knobs(tables, slot_ids: np.ndarray, counted: np.ndarray) -> AdjustKnobs:
    return AdjustKnobs(presence=tables.presence[slot_ids], frequency=tables.frequency[slot_ids],
                       repetition=tables.repetition[slot_ids], min_tokens=tables.min_tokens[slot_ids],
                       bias_ids=tables.bias_ids[slot_ids], bias=tables.bias[slot_ids],
                       bias_stops=tables.bias_stops[slot_ids], counted=counted)


def extend_adjust_knobs(chunks, num_seqs: int, tables, record_size: int) -> tuple[AdjustKnobs, TokenRecord]:
    """An extend step's AdjustKnobs, and the TokenRecord of its penalized chunks (record_size entries)."""
    slot_ids = np.zeros(num_seqs, np.int32)
    counted = np.zeros(num_seqs, bool)
    slots = np.zeros(record_size, np.int32)
    tokens = np.zeros(record_size, np.int32)
    is_output = np.zeros(record_size, bool)
    restarted = np.zeros(num_seqs, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        request, end = chunk.request, chunk.start + chunk.length
        slot_ids[i], counted[i] = request.slot, end == len(request.token_ids)
        if not request.params.penalized:
            continue
        restarted[i] = request.slot if chunk.start == 0 else 0
        slots[offset: offset + chunk.length] = request.slot
        tokens[offset: offset + chunk.length] = request.token_ids[chunk.start: end]
        is_output[offset: offset + chunk.length] = np.arange(chunk.start, end) >= len(request.prompt)
        offset += chunk.length
    return adjust_knobs(tables, slot_ids, counted), TokenRecord(slots, tokens, is_output, restarted)


def _sampling(tables, slot_ids: np.ndarray, ends: np.ndarray) -> SamplingKnobs:
    """The knobs of rows whose sampled token follows position ends - 1."""
    return SamplingKnobs(slot_ids=slot_ids, temperature=tables.temperature[slot_ids], top_p=tables.top_p[slot_ids],
                         top_k=tables.top_k[slot_ids], seed=tables.seed[slot_ids],
                         step=(ends - tables.prompt_len[slot_ids]).astype(np.int32))


def _state_copies(pairs: list[tuple[int, int]], count: int) -> tuple[np.ndarray, np.ndarray]:
    """[(from slot, to slot)] -> two int32[count] arrays, padded with null-slot copies (0 -> 0)."""
    sources, targets = np.zeros(count, np.int32), np.zeros(count, np.int32)
    for i, (source, target) in enumerate(pairs):
        sources[i], targets[i] = source, target
    return sources, targets


def extend_batch(chunks, num_tokens: int, num_seqs: int, tables, state_copies: int = 0
                 ) -> tuple[ExtendBatch, SamplingKnobs]:
    """chunks: the scheduler's `Chunk`s -> the extend step's batch (num_tokens / num_seqs rows, `state_copies`
    restores and saves of recurrent state) and knobs."""
    tokens = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    cu = np.zeros(num_seqs + 1, np.int32)
    slot_ids = np.zeros(num_seqs, np.int32)
    has_prefix = np.zeros(num_seqs, bool)
    ends = np.zeros(num_seqs, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        start, length = chunk.start, chunk.length
        tokens[offset: offset + length] = chunk.request.token_ids[start: start + length]
        positions[offset: offset + length] = np.arange(start, start + length)
        offset += length
        cu[i + 1] = offset
        slot_ids[i], has_prefix[i], ends[i] = chunk.request.slot, start > 0, start + length
    cu[len(chunks) + 1:] = offset  # padded sequences are empty
    restore_from, restore_to = _state_copies([c.stash for c in chunks if c.stash]
                                             + [(c.restore, c.request.slot) for c in chunks if c.restore],
                                             state_copies)
    save_from, save_to = _state_copies([(c.request.slot, c.save) for c in chunks if c.save], state_copies)
    batch = ExtendBatch(tokens=tokens, positions=positions, cu_seqlens=cu, slot_ids=slot_ids,
                        prompt_lens=tables.prompt_len[slot_ids], has_prefix=has_prefix,
                        page_table=tables.page_table[slot_ids], restore_from=restore_from, restore_to=restore_to,
                        save_from=save_from, save_to=save_to)
    return batch, _sampling(tables, slot_ids, ends)


def decode_batch(requests, rows: int, tables) -> tuple[DecodeBatch, SamplingKnobs]:
    """requests: the decode step's requests, their num_computed already counting this step's token."""
    slot_ids = np.zeros(rows, np.int32)
    positions = np.zeros(rows, np.int32)
    n = len(requests)
    slot_ids[:n] = np.fromiter((r.slot for r in requests), np.int32, n)
    positions[:n] = np.fromiter((r.num_computed - 1 for r in requests), np.int32, n)
    batch = DecodeBatch(positions=positions, slot_ids=slot_ids, page_table=tables.page_table[slot_ids])
    return batch, _sampling(tables, slot_ids, positions + 1)


def verify_batch(requests, rows: int, tables) -> tuple[VerifyBatch, SamplingKnobs]:
    """requests: the verify step's requests. The knobs' `step` (output index) is set on the device, from the
    position it keeps per slot."""
    slot_ids = np.zeros(rows, np.int32)
    n = len(requests)
    slot_ids[:n] = np.fromiter((r.slot for r in requests), np.int32, n)
    batch = VerifyBatch(slot_ids=slot_ids, prompt_lens=tables.prompt_len[slot_ids],
                        page_table=tables.page_table[slot_ids])
    return batch, _sampling(tables, slot_ids, tables.prompt_len[slot_ids])


def next_tokens(chunks, num_tokens: int) -> np.ndarray:
    """int32[num_tokens]: for each token of an extend batch (`extend_batch`'s packing), the request's token after
    it; -1 where that token is the one this step samples (the chunk ends the request's known tokens), 0 for padding.
    What the MTP layer reads beside each hidden state."""
    out = np.zeros(num_tokens, np.int32)
    offset = 0
    for chunk in chunks:
        start, length, token_ids = chunk.start, chunk.length, chunk.request.token_ids
        following = token_ids[start + 1: start + length + 1]
        out[offset: offset + len(following)] = following
        out[offset + len(following): offset + length] = -1
        offset += length
    return out
