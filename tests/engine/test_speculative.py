"""Speculative decoding with the MTP layers (engine.speculative) on tiny checkpoints whose MTP tensors the tests write
under their published names (float32, CPU).

Lossless: greedy tokens with speculation equal the model's greedy tokens (from its cache-free forward), whatever
the drafts: drafts that mostly agree with a context-dependent target (accept rate strictly between 0 and 1, so
partial acceptance, the Mamba commit at every accepted count and the cut-back caches all take part), random drafts
that almost never agree, and drafts that always agree (every draft accepted, k+1 tokens per target step).
Sampling: rejection sampling keeps the target's distribution (chi-square test against the exact distribution).

Limits are small (one prefill and one decode bucket) because each speculative engine compiles its verify and
draft programs; 5 prompts for 4 slots so that one joins while others decode; lengths that are multiples of nothing.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.engine import speculative
from jaxmodels.engine.batch import SamplingKnobs
from tests.engine.test_llm import greedy_by_full_forward, random_prompts
from tests.hf_mtp import save_with_drafting_mtp, save_with_mtp

# Warm-up "all": the one bucket of each kind before serving, and no samplers compiled for logit-adjusting requests,
# which no test here makes (the default warm-up compiles them in the background, for nothing).
LIMITS = dict(max_batch_size=4, max_seq_len=64, prefill_sizes=[8], decode_sizes=[4], progress=False,
              dtype="float32", warmup="all")
PROMPT_LENGTHS = [1, 3, 8, 13, 27]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def serve(path, k: int, prompts, params=GREEDY):
    llm = jaxmodels.LLM(path, num_speculative_tokens=k, **LIMITS)
    return llm, [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def nemotron_partial(tmp_path_factory):
    """Nemotron-H MoE (Mamba, attention, MoE; an attention + MoE MTP layer) whose drafts often agree, k = 3."""
    path = tmp_path_factory.mktemp("nemotron_partial")
    save_with_drafting_mtp("nemotron_h_moe", path, target_scale=0.1)
    return jaxmodels.LLM(path, num_speculative_tokens=3, **LIMITS)


@pytest.mark.parametrize("case", ["nemotron_partial", "deepseek_partial", "deepseek_random"])
def test_greedy_is_lossless(case, nemotron_partial, tmp_path):
    prompts = random_prompts(PROMPT_LENGTHS)
    if case == "nemotron_partial":
        llm = nemotron_partial
        outputs = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    elif case == "deepseek_partial":
        save_with_drafting_mtp("deepseek_v32", tmp_path, target_scale=0.3)
        llm, outputs = serve(tmp_path, 2, prompts)
    else:  # GLM-5 with a shared-indexer layer and a random MTP layer
        save_with_mtp("glm_moe_dsa", tmp_path)
        llm, outputs = serve(tmp_path, 2, prompts)
    assert outputs == greedy_by_full_forward(llm.model, prompts, NEW_TOKENS)
    metrics = llm.metrics()
    assert metrics["spec_draft_tokens"] > 0
    if case == "deepseek_random":
        assert metrics["spec_accept_rate"] < 0.1, metrics
    else:
        assert 0 < metrics["spec_accept_rate"] < 1, metrics
    # Per draft: accepted over accepted + rejected (one rejection per row that turned a draft down), at least the
    # share of all drafts, since drafts after a rejection count in the share but were never judged.
    assert metrics["spec_accept_rate"] <= metrics["spec_accept_per_draft"] < 1, metrics


def test_agreeing_drafter_is_always_accepted(tmp_path):
    k = 3
    save_with_drafting_mtp("nemotron_h_moe", tmp_path, target_scale=0.0)
    prompts = random_prompts(PROMPT_LENGTHS[1:])  # four prompts: one batch, decoding in lockstep
    llm, outputs = serve(tmp_path, k, prompts)
    assert outputs == greedy_by_full_forward(llm.model, prompts, NEW_TOKENS)
    metrics = llm.metrics()
    assert metrics["spec_accept_rate"] == metrics["spec_accept_per_draft"] == 1.0, metrics
    # The first token comes from the prompt's extend step; each verify step then yields k + 1: (k + 1)x fewer
    # target steps than the NEW_TOKENS - 1 of plain decoding. With overlapped scheduling one more step may be sent
    # before the last one's tokens show the requests done (its tokens are dropped).
    useful = math.ceil((NEW_TOKENS - 1) / (k + 1))
    assert useful <= metrics["decode_steps"] <= useful + 1, metrics


def test_sampling_keeps_the_target_distribution(nemotron_partial):
    """The second token of many seeded requests (drawn in a verify step, through rejection sampling against drafts
    that often agree) against the target's exact distribution given each request's prompt and first token: Pearson's
    chi-square over the tokens, bins with an expected count below 5 merged, at significance 1e-3."""
    llm = nemotron_partial
    prompt = random_prompts([5], seed=7)[0]
    temperature, requests = 1.5, 600
    params = [SamplingParams(max_new_tokens=2, temperature=temperature, seed=seed, ignore_eos=True)
              for seed in range(requests)]
    before = llm.metrics()["spec_accepted_tokens"]
    outputs = [out.token_ids for out in llm.generate([prompt] * requests, params)]
    assert llm.metrics()["spec_accepted_tokens"] > before  # drafts were accepted, not only rejected
    firsts = np.array([out[0] for out in outputs])
    graphdef, state = nnx.split(llm.model)
    contexts = np.array([prompt + [first] for first in range(llm.model.config.vocab_size)], np.int32)
    logits = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)[:, -1])(state, contexts)
    probs = np.asarray(jax.nn.softmax(logits / temperature, axis=-1), np.float64)
    expected = probs[firsts].sum(axis=0)
    observed = np.bincount([out[1] for out in outputs], minlength=len(expected))
    big = expected >= 5
    expected = np.append(expected[big], expected[~big].sum())
    observed = np.append(observed[big], observed[~big].sum())
    statistic = ((observed - expected) ** 2 / expected).sum()
    assert scipy.stats.chi2.sf(statistic, len(expected) - 1) > 1e-3, (statistic, len(expected))


def test_rejection_sampling_draws_from_the_target():
    """accept_sampled alone, on fixed logits over 6 tokens: the first token's frequencies over many seeds follow
    the target's probabilities whether the draft there is likely or not; greedy rows give accept_greedy's
    tokens."""
    vocab, draws = 6, 4000
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 3, vocab)) * 1.5, jnp.float32)
    target = np.asarray(jax.nn.softmax(logits[0, 0]), np.float64)
    for draft in (int(np.argmax(target)), int(np.argmin(target))):
        drafts = jnp.full((draws, 2), draft, jnp.int32)
        knobs = SamplingKnobs(slot_ids=jnp.zeros(draws, jnp.int32), temperature=jnp.ones(draws),
                              top_p=jnp.ones(draws), top_k=jnp.zeros(draws, jnp.int32),
                              seed=jnp.arange(draws, dtype=jnp.uint32), step=jnp.zeros(draws, jnp.int32))
        tokens, accepted = jax.jit(speculative.accept_sampled)(jnp.broadcast_to(logits, (draws, 3, vocab)), drafts,
                                                               knobs)
        observed = np.bincount(np.asarray(tokens[:, 0]), minlength=vocab)
        statistic = ((observed - draws * target) ** 2 / (draws * target)).sum()
        assert scipy.stats.chi2.sf(statistic, vocab - 1) > 1e-3, (draft, observed, draws * target)
        assert np.all(np.asarray(tokens[:, 0])[np.asarray(accepted) > 0] == draft)
    greedy_knobs = SamplingKnobs(slot_ids=jnp.zeros(2, jnp.int32), temperature=jnp.zeros(2), top_p=jnp.ones(2),
                                 top_k=jnp.zeros(2, jnp.int32), seed=jnp.arange(2, dtype=jnp.uint32),
                                 step=jnp.zeros(2, jnp.int32))
    two = jnp.broadcast_to(logits, (2, 3, vocab))
    argmax = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
    drafts = jnp.stack([argmax[:2], jnp.array([argmax[0], (argmax[1] + 1) % vocab])])
    expected = speculative.accept_greedy(two, drafts)
    got = speculative.accept_sampled(two, drafts, greedy_knobs)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(expected[1], [2, 1])


def test_speculation_needs_mtp_layers(tmp_path):
    from tests.hf_models import make_nemotron_h, save

    save(make_nemotron_h("dense"), tmp_path)
    with pytest.raises(ValueError, match="multi-token-prediction"):
        jaxmodels.LLM(tmp_path, num_speculative_tokens=2, **{**LIMITS, "warmup": False})


@pytest.mark.parametrize("launch_thread", [False, True])
def test_preemption_with_speculation_is_lossless(tmp_path, launch_thread):
    """A pool of 8 pages of 16 tokens for 4 requests that each need up to 5 (with the draft lookahead): requests are
    preempted and recomputed, drafts and MTP caches included; the same with the steps (extend and draft, verify)
    sent from a launch thread."""
    save_with_drafting_mtp("nemotron_h_moe", tmp_path, target_scale=0.1)
    llm = jaxmodels.LLM(tmp_path, num_speculative_tokens=2, launch_thread=launch_thread,
                        **{**LIMITS, "num_pages": 8})
    prompts = random_prompts([13, 27, 20, 9])
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = [out.token_ids for out in llm.generate(prompts, params)]
    assert llm.metrics()["preemptions"] > 0
    assert outputs == greedy_by_full_forward(llm.model, prompts, 24)


def test_speculation_resumes_from_cached_prefixes(nemotron_partial):
    """Prefix caching under speculation: later prompts resume from an earlier one's pages and state snapshot (the
    MTP layer's cache pages come with them), and greedy tokens stay the model's."""
    llm = nemotron_partial
    rng = np.random.default_rng(9)
    shared = rng.integers(3, 97, size=20).tolist()
    prompts = [shared + rng.integers(3, 97, size=n).tolist() for n in (5, 7, 9)]
    before = llm.metrics()["prefix_cache_hit_tokens"]
    outputs = [out.token_ids for out in llm.generate(prompts[:1], GREEDY)]
    outputs += [out.token_ids for out in llm.generate(prompts[1:], GREEDY)]
    assert llm.metrics()["prefix_cache_hit_tokens"] - before >= 2 * 16
    assert outputs == greedy_by_full_forward(llm.model, prompts, NEW_TOKENS)
