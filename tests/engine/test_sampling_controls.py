"""Penalties, logit_bias, min_tokens and logprobs (engine.sampler.sample_adjusted): the device's adjustment against
a numpy reference written here from SamplingParams' definitions, then served tokens and logprobs against
transformers' float32 logits, adjusted by the same reference, token by token (greedy, so the expected tokens follow
from the logits alone), also under preemption, which recomputes a penalized request's counts from its tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.engine import sampler
from jaxmodels.engine.batch import AdjustKnobs, TokenRecord
from jaxmodels.engine.request import BIAS_ENTRIES
from jaxmodels.engine.engine import InvalidRequest
from tests.engine.test_llm import random_prompts
from tests.hf_models import make_nemotron_h, save

V = 50
OPEN_MASK = jnp.full((3, 2), -1, jnp.int32)  # 3 rows of 64 bits: every token allowed


def reference_adjust(logits, *, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None,
                     min_tokens=0, stops=()):
    """One row's logits adjusted as SamplingParams documents it, in plain numpy."""
    logits = np.array(logits, np.float64)
    for token, value in (bias or {}).items():
        logits[token] += value
    if len(output) < min_tokens:
        logits[list(stops)] = -np.inf
    counts = np.bincount(np.asarray(output, int), minlength=len(logits))
    seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
    logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


def knobs_for(rows, *, slot_ids, step, temperature=None, min_tokens=None, presence=None, frequency=None,
              repetition=None, bias_entries=None):
    """SamplingKnobs and AdjustKnobs of `rows` rows; bias_entries[r]: [(token, bias, is_stop)]."""
    from jaxmodels.engine.batch import SamplingKnobs

    ids = np.zeros((rows, BIAS_ENTRIES), np.int32)
    bias = np.zeros((rows, BIAS_ENTRIES), np.float32)
    stops = np.zeros((rows, BIAS_ENTRIES), bool)
    for r, entries in enumerate(bias_entries or [[]] * rows):
        for i, (token, value, stop) in enumerate(entries):
            ids[r, i], bias[r, i], stops[r, i] = token, value, stop
    f32 = lambda x, default: np.asarray(x if x is not None else [default] * rows, np.float32)  # noqa: E731
    knobs = SamplingKnobs(slot_ids=np.asarray(slot_ids, np.int32), temperature=f32(temperature, 0.0),
                          top_p=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32),
                          seed=np.zeros(rows, np.uint32), step=np.asarray(step, np.int32))
    adjust = AdjustKnobs(presence=f32(presence, 0.0), frequency=f32(frequency, 0.0), repetition=f32(repetition, 1.0),
                         min_tokens=np.asarray(min_tokens or [0] * rows, np.int32), bias_ids=ids, bias=bias,
                         bias_stops=stops, counted=np.asarray(slot_ids) > 0)
    return knobs, adjust


def test_adjusted_logits_and_logprobs_follow_the_definitions():
    rng = np.random.default_rng(0)
    slots = 4
    prompts = {1: [3, 4, 4, 9], 2: [7], 3: [11, 12]}
    outputs = {1: [9, 9, 20], 2: [], 3: [5, 11]}
    counts = sampler.TokenCounts.zeros(slots, V)
    for slot in prompts:  # as extend steps record them: a prompt, then its recomputed outputs
        tokens = prompts[slot] + outputs[slot]
        record = TokenRecord(slots=np.full(len(tokens), slot, np.int32), tokens=np.asarray(tokens, np.int32),
                             is_output=np.arange(len(tokens)) >= len(prompts[slot]),
                             restarted=np.asarray([slot], np.int32))
        counts = sampler.record_tokens(counts, record)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 3
    settings = [dict(presence=0.5, frequency=0.3, repetition=1.4, bias={9: 2.0, 30: -5.0}),
                dict(repetition=0.7, min_tokens=2, stops=(2, 8), bias={2: 50.0}),
                dict(presence=-1.0, frequency=1.5, min_tokens=1, stops=(2,))]
    entries = [[(t, b, False) for t, b in s.get("bias", {}).items()] + [(t, -np.inf, True) for t in s.get("stops", ())]
               for s in settings]
    knobs, adjust = knobs_for(3, slot_ids=[1, 2, 3], step=[len(outputs[s]) for s in (1, 2, 3)],
                              temperature=[0.0, 0.8, 1.3], min_tokens=[s.get("min_tokens", 0) for s in settings],
                              presence=[s.get("presence", 0.0) for s in settings],
                              frequency=[s.get("frequency", 0.0) for s in settings],
                              repetition=[s.get("repetition", 1.0) for s in settings], bias_entries=entries)
    adjusted = np.asarray(sampler.adjust_logits(jnp.asarray(logits), knobs.slot_ids, knobs.step, adjust, counts))
    expected = np.stack([reference_adjust(logits[r], prompt=prompts[s], output=outputs[s], **settings[r])
                         for r, s in enumerate((1, 2, 3))])
    np.testing.assert_allclose(adjusted, expected, rtol=1e-6, atol=1e-5)
    assert adjusted[1, 2] == -np.inf and adjusted[1, 8] == -np.inf  # step 0 < min_tokens 2, the +50 bias too
    assert np.isfinite(adjusted[2, 2])  # step 2 >= min_tokens 1
    for greedy_only in (True, False):
        temperature = knobs.temperature if not greedy_only else np.zeros(3, np.float32)
        row_knobs = knobs.__class__(**{**knobs.__dict__, "temperature": temperature})
        tokens, chosen, top_ids, top_logprobs, after = jax.jit(
            sampler.sample_adjusted, static_argnames=("greedy_only", "top"))(
            jnp.asarray(logits), row_knobs, adjust, counts, OPEN_MASK, greedy_only=greedy_only, top=5)
        scale = np.where(temperature > 0, temperature, 1.0)[:, None]
        shifted = expected / scale
        reference = shifted - np.log(np.exp(shifted - shifted.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - shifted.max(-1, keepdims=True)
        tokens = np.asarray(tokens)
        if greedy_only:
            assert tokens.tolist() == expected.argmax(-1).tolist()
        np.testing.assert_allclose(np.asarray(chosen), reference[np.arange(3), tokens], atol=1e-5)
        assert np.asarray(top_ids).tolist() == np.argsort(-reference, axis=-1)[:, :5].tolist()
        np.testing.assert_allclose(np.asarray(top_logprobs), np.sort(reference, -1)[:, ::-1][:, :5], atol=1e-5)
        for r, slot in enumerate((1, 2, 3)):  # the drawn token is counted for the row's slot
            want = np.bincount(outputs[slot] + [tokens[r]], minlength=V)
            assert np.asarray(after.output[slot]).tolist() == want.tolist()


def test_a_restarted_slot_forgets_its_previous_request():
    counts = sampler.TokenCounts.zeros(3, V)
    first = TokenRecord(slots=np.array([1, 1, 1, 0], np.int32), tokens=np.array([4, 5, 6, 0], np.int32),
                        is_output=np.array([False, True, True, False]), restarted=np.array([1, 0], np.int32))
    counts = sampler.record_tokens(counts, first)
    assert np.flatnonzero(counts.in_prompt[1]).tolist() == [4] and counts.output[1, 5] == counts.output[1, 6] == 1
    again = TokenRecord(slots=np.array([1, 0, 0, 0], np.int32), tokens=np.array([8, 0, 0, 0], np.int32),
                        is_output=np.zeros(4, bool), restarted=np.array([1, 0], np.int32))
    counts = sampler.record_tokens(counts, again)
    assert np.flatnonzero(counts.in_prompt[1]).tolist() == [8] and not np.asarray(counts.output[1]).any()


# Served: a tiny float32 Nemotron-H, greedy, checked token by token against transformers' logits adjusted by the
# reference above. Pages of 8 tokens and 10 usable pages for 4 requests of up to 40 tokens: the last test preempts.
LIMITS = dict(dtype="float32", max_batch_size=4, max_seq_len=40, max_prefill_tokens=8, page_size=8, num_pages=11,
              progress=False, warmup="all")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf_model = make_nemotron_h("dense")
    llm = jaxmodels.LLM(save(hf_model, tmp_path_factory.mktemp("adjusted")), **LIMITS)
    # Compiled when the first request that needs them comes (its requests wait meanwhile), not with the buckets.
    assert llm.engine.runner.programs.on_demand_ready == {"sampling": False, "adjusting": False}
    return hf_model, llm


def hf_last_logits(hf_model, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0, -1].double().numpy()


def expected_greedy(hf_model, prompt, params: SamplingParams, eos=2):
    """Greedy tokens under `params`' adjustments, and each one's log probability, from transformers' logits."""
    output, logprobs = [], []
    settings = dict(presence=params.presence_penalty, frequency=params.frequency_penalty,
                    repetition=params.repetition_penalty, bias=params.logit_bias, min_tokens=params.min_tokens,
                    stops=(eos,))
    while len(output) < params.max_new_tokens:
        adjusted = reference_adjust(hf_last_logits(hf_model, prompt + output), prompt=prompt, output=output,
                                    **settings)
        token = int(adjusted.argmax())
        logprobs.append(adjusted - np.logaddexp.reduce(adjusted))
        output.append(token)
        if token == eos:
            break
    return output, logprobs


ADJUSTMENTS = [
    SamplingParams(max_new_tokens=12, temperature=0.0, repetition_penalty=1.8),
    SamplingParams(max_new_tokens=12, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(max_new_tokens=12, temperature=0.0, logit_bias={7: 4.0, 8: 3.5}, frequency_penalty=2.0),
    SamplingParams(max_new_tokens=12, temperature=0.0, logit_bias={2: 100.0}, min_tokens=3, logprobs=3),
]


def test_served_tokens_and_logprobs_follow_the_adjusted_logits(served):
    hf_model, llm = served
    prompts = random_prompts([5, 13, 9, 20], seed=8)
    outs = llm.generate(prompts, ADJUSTMENTS)
    for prompt, params, out in zip(prompts, ADJUSTMENTS, outs):
        tokens, logprobs = expected_greedy(hf_model, prompt, params)
        assert out.token_ids == tokens, params
        if params.logprobs is None:
            assert out.logprobs is None
            continue
        assert len(out.logprobs) == len(tokens)
        for token, row, (chosen, top) in zip(tokens, logprobs, out.logprobs):
            assert abs(chosen - row[token]) < 1e-4
            assert [t for t, _ in top] == np.argsort(-row)[:params.logprobs].tolist()
            np.testing.assert_allclose([lp for _, lp in top], np.sort(row)[::-1][:params.logprobs], atol=1e-4)
    # min_tokens held EOS back for 3 tokens, then the +100 bias made it the 4th.
    assert outs[3].token_ids[3] == 2 and 2 not in outs[3].token_ids[:3] and outs[3].finish_reason == "stop"


def test_logprobs_of_plain_requests_are_the_models(served):
    hf_model, llm = served
    prompt = random_prompts([11], seed=9)[0]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=0, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    for i, (token, (chosen, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        logits = hf_last_logits(hf_model, prompt + out.token_ids[:i])
        assert token == logits.argmax() and top == []
        assert abs(chosen - (logits[token] - np.logaddexp.reduce(logits))) < 1e-4
    sampled = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, logprobs=2)
    (out,) = llm.generate([prompt], sampled)
    for i, (token, (chosen, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        scaled = hf_last_logits(hf_model, prompt + out.token_ids[:i]) / 0.7
        assert abs(chosen - (scaled[token] - np.logaddexp.reduce(scaled))) < 1e-4 and len(top) == 2


def test_penalized_requests_under_preemption_recount_their_tokens(served):
    hf_model, llm = served
    preempted = llm.engine.scheduler.num_preemptions
    prompts = random_prompts([14, 17, 12, 16, 15], seed=10)  # 5 x ~30 tokens for 80 pool tokens
    params = [SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4,
                             ignore_eos=True)] * 5
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > preempted
    for prompt, out in zip(prompts, outs):
        expected, _ = expected_greedy(hf_model, prompt, SamplingParams(
            max_new_tokens=14, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4), eos=-1)
        assert out.token_ids == expected


@pytest.mark.parametrize("params, message", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(max_new_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
    (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
    (SamplingParams(logit_bias={t: 1.0 for t in range(BIAS_ENTRIES + 1)}), "logit_bias"),
    (SamplingParams(logprobs=21), "logprobs"),
])
def test_bad_values_are_rejected_naming_the_field(served, params, message):
    with pytest.raises(InvalidRequest, match=message):
        served[1].engine.add_request([5, 6], params)


@pytest.mark.parametrize("vocab, k", [(50, 20), (1000, 20), (131, 5), (4096, 1)])
def test_top_k_by_blocks_equals_lax_top_k(vocab, k):
    x = jnp.asarray(np.random.default_rng(vocab).normal(size=(6, vocab)).astype(np.float32))
    values, ids = sampler.top_k_by_blocks(x, k, block=16)
    want_values, want_ids = jax.lax.top_k(x, k)
    assert np.asarray(ids).tolist() == np.asarray(want_ids).tolist()
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
