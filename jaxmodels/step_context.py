"""What a cache-aware forward needs to know about the step it runs in: `StepContext`.

A model's forward is one function for every mode (`model(tokens, step=None, caches=None)`):
  * without a step: full causal sequences tokens[B, T], no cache (what the parity tests compare with transformers);
  * with a step: the engine's packed tokens[T] of several requests, over paged caches. Its kind is
    - `EXTEND`: chunks of prompts (a whole prompt, or the next chunk of a long one: chunked prefill), packed back to
      back by `cu_seqlens`;
    - `DECODE`: one token per request;
    - `VERIFY`: speculative decoding's check, the same number of tokens per request (its last token and the drafts
      after it), every token's logits returned. Attention treats it as an extend; recurrent layers compute the
      outputs but leave their state pools as they were and return what `commit_verified` needs to advance them by
      the tokens that turn out accepted.
The context is a pytree built inside the jitted step from the host's batch, so what is derived from the batch (each
token's sequence) is computed once per step, not once per layer; `write` stores a layer's new cache rows.

Layout. S sequences, T packed tokens (T >= cu_seqlens[S]; the tail is padding). A padding token has sequence id S,
one past the last, and `page_table` carries one extra all-zero row for it, so a padding token reads and writes only
page 0 and slot 0, the null page and slot that no real request owns. Padded sequences have length 0, slot 0 and an
all-zero page-table row.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from pallas_kernels.packing import token_sequence_ids


class StepKind(str, enum.Enum):
    """A str enum, so the engine's tables keyed by "extend" / "decode" accept either spelling."""

    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepContext:
    kind: StepKind = dataclasses.field(metadata=dict(static=True))
    positions: jax.Array  # int32[T]: each token's position in its request
    seq_ids: jax.Array  # int32[T]: each token's sequence, S for padding
    cu_seqlens: jax.Array  # int32[S+1]
    page_table: jax.Array  # int32[S+1, P]: the sequences' page rows, then the zero row of padding tokens
    slot_ids: jax.Array  # int32[S]: each sequence's state slot (Mamba), 0 for padded sequences
    has_prefix: jax.Array  # bool[S]: the sequence continues from cached state (false: its first chunk)
    prompt_lens: jax.Array  # int32[S]
    logit_rows: jax.Array  # int32[R]: the tokens whose logits the step returns
    # The mesh axis of data-parallel groups when the step runs inside the engine's shard_map over it (each group its
    # own requests and caches); MLP / MoE layers whose weights are split over it gather all groups' tokens.
    dp_axis: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def is_decode(self) -> bool:
        return self.kind is StepKind.DECODE

    @property
    def num_seqs(self) -> int:
        return self.slot_ids.shape[0]

    @property
    def sequence_pages(self) -> jax.Array:
        """int32[S, P]: the sequences' page-table rows (without the padding row)."""
        return self.page_table[:-1]

    def write(self, pages: jax.Array, new: jax.Array) -> jax.Array:
        """Store new[T, ...] at each token's position in a paged cache pages[num_pages, page_size, ...]: the page is
        its sequence's page-table entry for the position. A padding token (the zero row, position 0) writes page 0,
        the null page no real request reads."""
        page_size = pages.shape[1]
        page = self.page_table[self.seq_ids, self.positions // page_size]
        return pages.at[page, self.positions % page_size].set(new.astype(pages.dtype))

    def token_prompt_lens(self) -> jax.Array:
        """int32[T]: the prompt length of each token's request (that of the last sequence for padding tokens)."""
        return self.prompt_lens[jnp.minimum(self.seq_ids, self.num_seqs - 1)]

    @classmethod
    def extend(cls, *, positions, cu_seqlens, page_table, slot_ids, has_prefix, prompt_lens,
               dp_axis: str | None = None) -> "StepContext":
        """Packed chunks; the logits returned are those of each sequence's last token."""
        num_tokens = positions.shape[0]
        return cls(kind=StepKind.EXTEND, positions=positions, seq_ids=token_sequence_ids(cu_seqlens, num_tokens),
                   cu_seqlens=cu_seqlens, page_table=_with_null_row(page_table), slot_ids=slot_ids,
                   has_prefix=has_prefix, prompt_lens=prompt_lens,
                   logit_rows=jnp.clip(cu_seqlens[1:] - 1, 0, num_tokens - 1), dp_axis=dp_axis)

    @classmethod
    def verify(cls, *, positions, page_table, slot_ids, prompt_lens, dp_axis: str | None = None) -> "StepContext":
        """positions int32[S, L]: L consecutive positions per request (its last token's, then the drafts'), packed
        row by row; every token's logits are returned, in that order."""
        num_seqs, length = positions.shape
        return cls(kind=StepKind.VERIFY, positions=positions.reshape(-1),
                   seq_ids=jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), length),
                   cu_seqlens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * length,
                   page_table=_with_null_row(page_table), slot_ids=slot_ids, has_prefix=jnp.ones(num_seqs, bool),
                   prompt_lens=prompt_lens, logit_rows=jnp.arange(num_seqs * length, dtype=jnp.int32),
                   dp_axis=dp_axis)

    @classmethod
    def decode(cls, *, positions, page_table, slot_ids, dp_axis: str | None = None) -> "StepContext":
        """One token per request (row b is sequence b); every row's logits are returned."""
        rows = jnp.arange(positions.shape[0], dtype=jnp.int32)
        return cls(kind=StepKind.DECODE, positions=positions, seq_ids=rows,
                   cu_seqlens=jnp.arange(positions.shape[0] + 1, dtype=jnp.int32),
                   page_table=_with_null_row(page_table), slot_ids=slot_ids, has_prefix=jnp.ones(rows.shape, bool),
                   prompt_lens=jnp.zeros_like(positions), logit_rows=rows,  # decode reads no prompt length
                   dp_axis=dp_axis)


def _with_null_row(page_table):
    return jnp.concatenate([page_table, jnp.zeros_like(page_table[:1])])
