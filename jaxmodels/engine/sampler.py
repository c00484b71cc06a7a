"""Token sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds.

Every knob is an array, one entry per row, so one executable serves any mix of requests. Randomness comes from
fold_in(key(seed), step) where step is the number of tokens the request has generated so far: a request draws the
same token whatever batch it lands in, and again when it is recomputed after preemption.

Two functions, one program each: `greedy` (an argmax) and `sample` (every knob; one descending sort of the
vocabulary serves top-k and top-p, which costs real time at 100k+ tokens). The engine picks one per step on the host,
from the batch's temperatures. Choosing on the device with an XLA conditional would stall the GPU engine: a
conditional copies its predicate to the host and waits for it, blocking the thread that launches steps.

A step with a request that adjusts its logits (penalties, logit_bias, min_tokens), constrains its output to a
grammar (a bitmask of the tokens allowed next, computed on the host: engine.grammar) or asks for logprobs runs
`sample_adjusted` instead (greedy or not, again chosen on the host), which also returns the logprobs. Penalties need
each request's counts of the tokens it has seen, which the device keeps per slot (`TokenCounts`): prompt tokens
(`record_tokens`, as an extend step computes them) and output tokens (as they are drawn). A penalized request is
computed from its first token whenever it is admitted (it takes no cached prefix), so its counts are always whole.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.packing import prefix_sum


def greedy(logits):
    """logits[B,V] -> int32[B], the argmax of each row."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits, temperature, top_k, top_p, seed, step):
    """logits[B,V] float32; temperature/top_p float32[B]; top_k int32[B] (<= 0: off); seed uint32[B];
    step int32[B] -> int32[B]. temperature 0 means greedy (that row's argmax)."""
    order, ranked = _ranked_filtered(logits, temperature, top_k, top_p)

    def draw(row_logits, row_seed, row_step):
        key = jax.random.fold_in(jax.random.key(row_seed), row_step)
        return jax.random.categorical(key, row_logits)

    picked_rank = jax.vmap(draw)(ranked, seed, step)
    sampled = jnp.take_along_axis(order, picked_rank[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy(logits))


def filtered_logits(logits, temperature, top_k, top_p):
    """logits[B,V] -> the logits `sample` draws from, in vocabulary order: divided by the temperature, -inf where
    top-k or top-p drops the token. (Rows with temperature 0 come out at temperature 1; callers treat them as
    greedy.)"""
    order, ranked = _ranked_filtered(logits, temperature, top_k, top_p)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.zeros_like(ranked).at[rows, order].set(ranked)


def _ranked_filtered(logits, temperature, top_k, top_p):
    """(order, ranked): each row's tokens by descending logit, and their temperature-scaled logits in that order
    with -inf past top-k and top-p."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    # One descending sort serves both filters: top-k keeps ranks < k, top-p keeps the smallest prefix whose
    # probability mass reaches p (the first token always survives).
    order = jnp.argsort(-scaled, axis=-1)
    ranked = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranked = jnp.where(rank < k[:, None], ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_before = prefix_sum(probs, axis=1) - probs  # (not jnp.cumsum: see pallas_kernels.packing)
    return order, jnp.where(mass_before < top_p[:, None], ranked, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """Per slot: how often each token was drawn as an output (int32[slots, V]) and which tokens its prompt holds
    (bool[slots, V]); read for penalized requests only, so other slots' rows are whatever they were."""

    output: jax.Array
    in_prompt: jax.Array

    @classmethod
    def zeros(cls, slots: int, vocab_size: int) -> "TokenCounts":
        return cls(jnp.zeros((slots, vocab_size), jnp.int32), jnp.zeros((slots, vocab_size), bool))


def record_tokens(counts: TokenCounts, record) -> TokenCounts:
    """An extend step's penalized tokens (batch.TokenRecord) into the counts, after clearing the slots whose request
    starts over (padding lands in the null slot 0)."""
    output = counts.output.at[record.restarted].set(0)
    in_prompt = counts.in_prompt.at[record.restarted].set(False)
    output = output.at[record.slots, record.tokens].add(record.is_output.astype(jnp.int32))
    in_prompt = in_prompt.at[record.slots, record.tokens].max(~record.is_output)
    return TokenCounts(output, in_prompt)


def adjust_logits(logits, slot_ids, step, adjust, counts: TokenCounts):
    """logits[R, V] float32 -> after logit_bias, min_tokens and the penalties (SamplingParams says how).
    step int32[R]: the index of the output token being drawn; adjust: batch.AdjustKnobs."""
    rows = jnp.arange(logits.shape[0])[:, None]
    holding = adjust.bias_stops & (step < adjust.min_tokens)[:, None]  # min_tokens: stop tokens at -inf
    bias = jnp.where(adjust.bias_stops & ~holding, 0.0, adjust.bias)
    logits = logits.at[rows, adjust.bias_ids].add(bias)
    output = counts.output[slot_ids]
    drawn = output > 0
    seen = drawn | counts.in_prompt[slot_ids]
    repetition = adjust.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return (logits - adjust.frequency[:, None] * output.astype(logits.dtype)
            - adjust.presence[:, None] * drawn.astype(logits.dtype))


def allowed_tokens(bitmask, vocab_size: int):
    """int32[R, W] bitmasks (token i allowed: bit i % 32 of word i // 32, as engine.grammar writes them) ->
    bool[R, vocab_size]."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # an arithmetic shift: & 1 keeps bit k
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(bool)


def sample_adjusted(logits, knobs, adjust, counts: TokenCounts, bitmask, *, greedy_only: bool, top: int):
    """The sampler of a step with adjusted, constrained or logprob-reporting requests: -> (tokens int32[R], each
    token's log probability [R], the `top` most likely tokens int32[R, top] and their log probabilities [R, top],
    counts with the counted rows' tokens added). `bitmask` int32[R, ceil(V / 32)]: the tokens each row may draw
    (structured output; -1, every bit set, for a row without). `greedy_only`: every row is greedy (no sort of the
    vocabulary)."""
    adjusted = adjust_logits(logits, knobs.slot_ids, knobs.step, adjust, counts)
    # An allowed token at -inf (min_tokens holding EOS back where the grammar allows only EOS, or a model's own -inf)
    # stays drawable below every finite logit: the grammar wins, a row never has nothing to draw.
    lowest = jnp.finfo(adjusted.dtype).min
    adjusted = jnp.where(allowed_tokens(bitmask, logits.shape[-1]), jnp.maximum(adjusted, lowest), -jnp.inf)
    if greedy_only:
        tokens = greedy(adjusted)
    else:
        tokens = sample(adjusted, knobs.temperature, knobs.top_k, knobs.top_p, knobs.seed, knobs.step)
    scaled = adjusted / jnp.where(knobs.temperature > 0, knobs.temperature, 1.0)[:, None]
    # log p = scaled - logsumexp(scaled), taken only where read: no [R, V] array of logprobs is written.
    normalizer = jax.scipy.special.logsumexp(scaled, axis=-1)
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - normalizer
    top_scaled, top_ids = top_k_by_blocks(scaled, top)
    output = counts.output.at[knobs.slot_ids, tokens].add(adjust.counted.astype(jnp.int32))
    return (tokens, chosen, top_ids, top_scaled - normalizer[:, None],
            dataclasses.replace(counts, output=output))


def top_k_by_blocks(x, k: int, block: int = 128):
    """lax.top_k(x, k) of x[R, V] (values and int32 ids; ties may come in another order) without sorting whole rows,
    which XLA does on the GPU past small k (2 ms a step at 256 x 131k): the k largest lie in the k blocks of
    `block` entries with the largest maxima (a block holding one of them has a maximum no smaller, and fewer than k
    blocks can have a larger one), so only those blocks' entries are ranked."""
    rows, vocab = x.shape
    blocks = jnp.pad(x, ((0, 0), (0, -vocab % block)), constant_values=-jnp.inf).reshape(rows, -1, block)
    _, picked = jax.lax.top_k(blocks.max(axis=-1), min(k, blocks.shape[1]))
    candidates = jnp.take_along_axis(blocks, picked[:, :, None], axis=1).reshape(rows, -1)
    values, index = jax.lax.top_k(candidates, k)
    ids = (picked[:, :, None] * block + jnp.arange(block)).reshape(rows, -1)
    return values, jnp.take_along_axis(ids, index, axis=1).astype(jnp.int32)
