"""Token sampling on the device: greedy, temperature, top-k, top-p, with per-request seeds.

Every knob is an array, one entry per row, so one executable serves any mix of requests. Randomness comes from
fold_in(key(seed), step) where step is the number of tokens the request has generated so far: a request draws the
same token whatever batch it lands in, and again when it is recomputed after preemption.

Two functions, one program each: `greedy` (an argmax) and `sample` (every knob; one descending sort of the
vocabulary serves top-k and top-p, which costs real time at 100k+ tokens). The engine picks one per step on the host,
from the batch's temperatures. Choosing on the device with an XLA conditional would stall the GPU engine: a
conditional copies its predicate to the host and waits for it, blocking the thread that launches steps.
"""

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
