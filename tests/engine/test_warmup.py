"""Start-up: the engine serves once the largest buckets are compiled, the others compile in the background and are
switched in as they are ready; outputs do not depend on which buckets are ready, and nothing compiles on the step
path (engine.warmup)."""

import pytest

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.engine.warmup import compile_order, warmup_mode
from jaxmodels.step_context import StepKind
from tests.engine.test_llm import GREEDY, PROMPT_LENGTHS, count_compilations, hf_greedy, random_prompts
from tests.hf_models import make_nemotron_h, save


def test_compile_order_starts_with_the_largest_then_bisects():
    # 64 covers all; then the middle of the rest (8), then the middles of [1, 2, 4] and [16, 32], then what is left.
    assert compile_order([1, 2, 4, 8, 16, 32, 64]) == [64, 8, 2, 32, 1, 4, 16]
    assert compile_order([16, 4, 8]) == [16, 8, 4]
    assert compile_order([5]) == [5]


def test_warmup_modes():
    assert warmup_mode(True) == "background"
    assert warmup_mode(False) == "none"
    assert warmup_mode("all") == "all"
    with pytest.raises(ValueError, match="warmup must be"):
        warmup_mode("eager")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    hf_model = make_nemotron_h("moe")
    return hf_model, save(hf_model, tmp_path_factory.mktemp("moe_warmup"))


def record_buckets(monkeypatch, runner) -> list[tuple]:
    """The (program, bucket) of every forward executable the runner calls from now on."""
    called = []
    executable = runner.programs.executable

    def recording(job):
        if job[0] != "sampler":
            called.append(job[:2])
        return executable(job)

    monkeypatch.setattr(runner.programs, "executable", recording)
    return called


def test_tokens_with_only_the_largest_buckets_equal_those_with_all(moe_checkpoint, monkeypatch):
    hf_model, path = moe_checkpoint
    llm = jaxmodels.LLM(path, dtype="float32", max_batch_size=4, max_seq_len=64, prefill_sizes=[8, 32],
                        decode_sizes=[1, 4], warmup="covering", progress=False)
    runner = llm.engine.runner
    assert runner.programs.ready_buckets() == {StepKind.EXTEND: [32], StepKind.DECODE: [4]}
    assert llm.metrics()["buckets_compiling"] == 2
    prompts = random_prompts(PROMPT_LENGTHS)
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=7)
    called = record_buckets(monkeypatch, runner)
    with count_compilations() as count:
        padded = [llm.generate(prompts, params) for params in (GREEDY, sampled)]
        alone = llm.generate(prompts[:1], GREEDY)  # one row, padded to the 4-row bucket
    assert count[0] == 0
    assert set(called) == {(StepKind.EXTEND, 32), (StepKind.DECODE, 4)}

    llm.engine.compile_remaining()
    assert runner.programs.ready_buckets() == {StepKind.EXTEND: [8, 32], StepKind.DECODE: [1, 4]}
    assert llm.metrics()["buckets_compiling"] == 0
    called.clear()
    assert [llm.generate(prompts, params) for params in (GREEDY, sampled)] == padded
    assert llm.generate(prompts[:1], GREEDY) == alone
    assert {(StepKind.EXTEND, 8), (StepKind.DECODE, 1)} <= set(called)
    for prompt, out in zip(prompts, padded[0]):
        assert out.token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"


def test_default_start_serves_at_once_while_the_rest_compiles(moe_checkpoint):
    """The default limits a new user would give (256 requests, 2048 tokens: dozens of buckets): the constructor
    returns once the largest prefill and decode buckets are compiled, the first requests give transformers' tokens
    while the others compile, and the step path compiles nothing (the warm-up's own compile threads aside)."""
    hf_model, path = moe_checkpoint
    with jaxmodels.LLM(path, dtype="float32", max_batch_size=256, max_seq_len=2048, progress=False) as llm:
        metrics = llm.metrics()
        assert metrics["ready_s"] > 0
        assert metrics["buckets_ready"] >= 2
        prompts = random_prompts([5, 19])
        with count_compilations() as count:
            outs = llm.generate(prompts, GREEDY)
        assert llm.metrics()["buckets_compiling"] > 0, "the test needs requests served while buckets compile"
    assert count[0] == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"
