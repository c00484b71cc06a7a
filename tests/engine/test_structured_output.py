"""Structured output in the engine (SamplingParams.structured_output): the device draws under the host's bitmask as
the numpy reference does, and served outputs of a random-weight model always parse and follow their JSON schema,
regex or choice, whatever else shares their batches and however steps are launched."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")  # the GPU machine may lack the [serve] extra's packages
jsonschema = pytest.importorskip("jsonschema")

import jaxmodels  # noqa: E402
from jaxmodels import SamplingParams  # noqa: E402
from jaxmodels.engine import sampler  # noqa: E402
from jaxmodels.engine.engine import InvalidRequest  # noqa: E402
from jaxmodels.engine.grammar import GrammarSpec, allowed_token_mask, apply_bitmask  # noqa: E402
from tests.engine.test_llm import random_prompts  # noqa: E402
from tests.engine.test_sampling_controls import knobs_for  # noqa: E402
from tests.serve.checkpoint import write_checkpoint  # noqa: E402

V = 70  # not a multiple of 32: the last mask word is partial


def random_bitmask(rng, rows: int) -> np.ndarray:
    allowed = rng.random((rows, 96)) < 0.3
    allowed[:, V:] = False
    allowed[np.arange(rows), rng.integers(0, V, rows)] = True  # never empty
    return np.packbits(allowed, axis=-1, bitorder="little").view(np.int32)


def test_the_device_draws_under_the_bitmask_as_the_reference_says():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    bitmask = random_bitmask(rng, 4)
    bitmask[3] = -1  # an unconstrained row
    assert np.asarray(sampler.allowed_tokens(jnp.asarray(bitmask), V)).tolist() == \
        allowed_token_mask(bitmask, V).tolist()
    masked = apply_bitmask(logits, bitmask).astype(np.float64)
    counts = sampler.TokenCounts.zeros(5, V)
    sample = jax.jit(sampler.sample_adjusted, static_argnames=("greedy_only", "top"))
    for temperature in (0.0, 0.9):
        knobs, adjust = knobs_for(4, slot_ids=[1, 2, 3, 4], step=[0, 1, 2, 3], temperature=[temperature] * 4)
        for seed in range(8):
            knobs = knobs.__class__(**{**knobs.__dict__, "seed": np.full(4, seed, np.uint32)})
            tokens, chosen, top_ids, top_logprobs, _ = sample(jnp.asarray(logits), knobs, adjust, counts,
                                                              jnp.asarray(bitmask), greedy_only=temperature == 0,
                                                              top=3)
            tokens = np.asarray(tokens)
            assert allowed_token_mask(bitmask, V)[np.arange(4), tokens].all()
            if temperature == 0:
                assert tokens.tolist() == masked.argmax(-1).tolist()
            scaled = masked / (temperature or 1.0)
            reference = scaled - np.logaddexp.reduce(scaled, axis=-1, keepdims=True)
            np.testing.assert_allclose(np.asarray(chosen), reference[np.arange(4), tokens], atol=1e-5)
            np.testing.assert_allclose(np.asarray(top_logprobs), np.sort(reference, -1)[:, ::-1][:, :3], atol=1e-5)


# Bounded schemas (maxLength, enums, maxItems, no additional properties): a random-weight model's output must
# complete within the token budget, whatever it draws.
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "address"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]},
                                      "note": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["ok", "level"], "additionalProperties": False},
]
LIMITS = dict(dtype="float32", max_batch_size=4, max_seq_len=256, max_prefill_tokens=16, progress=False,
              prefill_sizes=[16], decode_sizes=[4])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return jaxmodels.LLM(checkpoint, **LIMITS)


def constrained(spec, seed, **kwargs):
    return SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed, structured_output=spec, **kwargs)


def test_sampled_json_follows_its_schema(llm):
    prompts = random_prompts([5, 19, 9, 30, 7, 12], seed=1, vocab=llm.engine.config.vocab_size)
    params = [constrained(GrammarSpec.json_schema(SCHEMAS[i % 3]), seed=i) for i in range(6)]
    for prompt_params, out in zip(params, llm.generate(prompts, params)):
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), json.loads(prompt_params.structured_output.source))
        assert 1 not in out.token_ids  # the request stops once the JSON is complete, without drawing EOS


def test_regex_choice_and_any_object(llm):
    prompts = random_prompts([6, 11, 8], seed=2, vocab=llm.engine.config.vocab_size)
    specs = [GrammarSpec.regex(r"[a-f]{2,5}-[0-9]{3}"), GrammarSpec.choice(["yes", "no", "maybe"]),
             GrammarSpec.json_object()]
    outs = llm.generate(prompts, [constrained(spec, seed=5) for spec in specs])
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe")
    assert outs[2].finish_reason in ("stop", "length")
    if outs[2].finish_reason == "stop":  # an unbounded object may run out of tokens; a complete one parses
        assert isinstance(json.loads(outs[2].text), dict)


def test_unconstrained_neighbours_and_launch_modes_keep_their_tokens(llm, checkpoint):
    """A greedy request gives the same tokens beside constrained ones as alone, and constrained requests give the
    same tokens with and without overlap or a launch thread (the masks never see a token early or late)."""
    vocab = llm.engine.config.vocab_size
    prompts = random_prompts([9, 14, 21, 6], seed=3, vocab=vocab)
    plain = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    (alone,) = llm.generate([prompts[0]], plain)
    params = [plain] + [constrained(GrammarSpec.json_schema(SCHEMAS[i]), seed=10 + i) for i in range(3)]
    mixed = llm.generate(prompts, params)
    assert mixed[0].token_ids == alone.token_ids
    for options in (dict(overlap=False), dict(launch_thread=False)):
        other = jaxmodels.LLM(checkpoint, **LIMITS, **options)
        assert [o.token_ids for o in other.generate(prompts, params)] == [o.token_ids for o in mixed], options


def test_structured_output_refusals(llm, checkpoint):
    with pytest.raises(InvalidRequest, match="structured_output: invalid regex"):
        llm.engine.add_request([5, 6], SamplingParams(structured_output=GrammarSpec.regex("(unclosed")))
    with pytest.raises(InvalidRequest, match="structured_output must be a GrammarSpec"):
        llm.engine.add_request([5, 6], SamplingParams(structured_output={"type": "object"}))
    model_only = jaxmodels.LLM(None, model=llm.model, **LIMITS, warmup=False)
    with pytest.raises(InvalidRequest, match="needs the model's tokenizer"):
        model_only.engine.add_request([5, 6], SamplingParams(structured_output=GrammarSpec.json_object()))


def test_the_benchmark_measures_decoding_under_a_json_schema(tmp_path, capsys):
    """`--sampling json`: every request of the decode phase stays constrained (BENCH_SCHEMA cannot complete in
    the phase's steps), with a tokenizer given for the random model."""
    from jaxmodels.__main__ import main
    from tests.jaxmodels.test_benchmark import TINY
    from tests.serve.checkpoint import byte_level_tokenizer

    config, tokenizer, results = tmp_path / "config.json", tmp_path / "tokenizer.json", tmp_path / "results.json"
    config.write_text(json.dumps({**TINY, "vocab_size": 512, "eos_token_id": 1}))
    byte_level_tokenizer(vocab_size=400).save(str(tokenizer))
    main(["bench", "--config", str(config), "--layers", "2", "--phases", "decode", "--batches", "3",
          "--prompt-len", "8", "--decode-steps", "6", "--dtype", "float32", "--no-progress", "--json", str(results),
          "--sampling", "plain,json", "--tokenizer", str(tokenizer)])
    rows = json.loads(results.read_text())["decode"]
    assert [(row["batch"], row["sampling"]) for row in rows] == [(3, "plain"), (3, "json")]
    assert all(row["step_ms"] > 0 for row in rows)
    with pytest.raises(SystemExit, match="needs --tokenizer"):
        main(["bench", "--config", str(config), "--phases", "decode", "--sampling", "json", "--no-progress"])
