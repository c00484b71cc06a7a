"""Speculative decoding with the model's multi-token-prediction (MTP) layers: draft k tokens, verify them in one
target step, keep the accepted ones and one token more.

Per request, the device keeps its last token and k drafts per slot. One VERIFY step per request:
  1. the target runs over [last token, draft_1 .. draft_k] at positions L .. L+k (L: the last token's position);
  2. acceptance (greedy: a draft stands while it equals the target's argmax; sampling: rejection sampling, so the
     output distribution is the target's) gives `accepted` = a in 0..k, and the tokens out_0 .. out_a: the accepted
     drafts and the target's own token after them;
  3. recurrent state advances by the a + 1 tokens that stand (`commit_verified`); attention keys past L + a stay,
     unread, until the next step overwrites them;
  4. the MTP layer runs over the same positions with each position's next token (out_i), which writes its own
     cache, and its output at position L + a drafts the next step's first token; deeper drafts chain one token at a
     time (depth j at position L + a + j).
After an extend step, the MTP layer runs over the chunk the same way, so its cache follows the prompt.

Drafts are greedy (the draft distribution is one-hot), which makes rejection sampling simple: a draft d is accepted
with probability p(d), and after a rejection the token is drawn from p with d removed (the normalised
max(0, p - q)). If all k drafts stand, the token after them is drawn from p. Greedy rows are the case p = one-hot.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxmodels.engine.sampler import filtered_logits
from jaxmodels.step_context import StepContext


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftState:
    """What the device keeps per slot between steps: the drafts for the slot's next verify step and the position of
    its last token. The position lives here, not on the host, so a verify step can be sent before the previous
    one's accepted count has come back (overlapped scheduling)."""

    tokens: jax.Array  # int32[slots, k]
    positions: jax.Array  # int32[slots]

    @classmethod
    def zeros(cls, num_slots: int, k: int) -> "DraftState":
        return cls(tokens=jnp.zeros((num_slots, k), jnp.int32), positions=jnp.zeros((num_slots,), jnp.int32))

    def set(self, slots, tokens, positions) -> "DraftState":
        return DraftState(tokens=self.tokens.at[slots].set(tokens), positions=self.positions.at[slots].set(positions))


def draft_chain(model, hidden, first_positions, page_table, slot_ids, caches, num_drafts: int,
                dp_axis: str | None = None):
    """Greedy drafts of each row from an MTP output: hidden[S, H] is the MTP layer's output at position
    first_positions[S], whose logits give draft 1; draft j + 1 comes from the MTP layer run at position
    first_positions + j on (the previous output, draft j). -> (int32[S, num_drafts], the MTP caches)."""
    drafts = [greedy_token(model, hidden)]
    for depth in range(1, num_drafts):
        step = StepContext.decode(positions=first_positions + depth, page_table=page_table, slot_ids=slot_ids,
                                  dp_axis=dp_axis)
        hidden, caches = model.mtp_forward(hidden, drafts[-1], step, caches, depth=depth)
        drafts.append(greedy_token(model, hidden))
    return jnp.stack(drafts, axis=1), caches


def greedy_token(model, hidden):
    return jnp.argmax(model.logits(hidden), axis=-1).astype(jnp.int32)


def accept_greedy(logits, drafts):
    """logits[S, k+1, V] of the verified positions, drafts int32[S, k] -> (tokens int32[S, k+1], accepted int32[S]):
    tokens are the target's argmax at each position; the first `accepted` equal the drafts."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, _accepted_prefix(drafts == tokens[:, :-1])


def accept_sampled(logits, drafts, knobs):
    """Rejection sampling against greedy drafts. logits[S, k+1, V]; drafts int32[S, k]; knobs as the sampler's, with
    `step` the output index of the token after position L -> (tokens int32[S, k+1], accepted int32[S]).

    Position i's token (output index step + i) draws from keys folded from (seed, step + i): the accept test from
    one, the replacement or bonus token from another, so a request's randomness does not depend on its batch.
    """
    rows, width, vocab = logits.shape
    k = width - 1
    probs = jax.nn.softmax(_per_position(filtered_logits, logits, knobs), axis=-1)  # [S, k+1, V]
    greedy_rows = knobs.temperature <= 0
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=probs.dtype)
    probs = jnp.where(greedy_rows[:, None, None], one_hot, probs)
    keys = jax.vmap(lambda seed, step: jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), step + i))(
        jnp.arange(width)))(knobs.seed, knobs.step)  # [S, k+1]
    uniform = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 0))))(keys[:, :k])
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    accepted = _accepted_prefix(uniform < p_draft)
    # The token at each position if the drafts stand up to it: p minus the draft there (after a rejection), or p
    # itself after the last draft.
    rejected_draft = jnp.concatenate([jax.nn.one_hot(drafts, vocab, dtype=bool),
                                      jnp.zeros((rows, 1, vocab), bool)], axis=1)
    residual = jnp.where(rejected_draft, 0.0, probs)
    drawn = jax.vmap(jax.vmap(lambda key, p: jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(p))))(
        keys, residual).astype(jnp.int32)
    position = jnp.arange(width)
    padded_drafts = jnp.concatenate([drafts, drafts[:, -1:]], axis=1)
    tokens = jnp.where(position[None] < accepted[:, None], padded_drafts, drawn)
    return tokens, accepted


def _per_position(fn, logits, knobs):
    """fn(logits[R, V], temperature, top_k, top_p) applied to logits[S, L, V] with each row's knobs repeated."""
    rows, width, vocab = logits.shape
    repeat = lambda a: jnp.repeat(a, width)  # noqa: E731
    out = fn(logits.reshape(rows * width, vocab), repeat(knobs.temperature), repeat(knobs.top_k),
             repeat(knobs.top_p))
    return out.reshape(rows, width, vocab)


def _accepted_prefix(matches):
    """bool[S, k] -> int32[S]: how many leading entries are true."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
