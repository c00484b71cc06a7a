"""End-to-end serving tests on tiny random Nemotron-H checkpoints (float32, CPU).

Limits are small on purpose (max_batch_size 4, 8-token prefill chunks: 5 buckets per engine) so compiling stays
cheap; 8-token chunks also split every prompt longer than 8 across steps, and the model's Mamba chunk size is 8, so
prompts of 13 and 27 tokens span several Mamba chunks and several prefill steps.
"""

import contextlib
import threading

import numpy as np
import pytest
import torch

import jaxmodels
from jaxmodels import SamplingParams
from tests.hf_models import make_dsa, make_nemotron_h, save

LIMITS = dict(max_batch_size=4, max_seq_len=64, max_prefill_tokens=8, progress=False)
PROMPT_LENGTHS = [1, 3, 8, 13, 27]  # five prompts for four slots: one joins as another finishes
NEW_TOKENS = 10
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)


def random_prompts(lengths, seed=0, vocab=97):
    rng = np.random.default_rng(seed)
    # Ids from 3 up: a prompt holding EOS (2) is fine, but keeps the tests' intent obvious.
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def hf_greedy(hf_model, prompt, max_new_tokens=NEW_TOKENS):
    """transformers' greedy generate for one prompt (stops at EOS like ours)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def greedy_by_full_forward(model, prompts, max_new_tokens):
    """Greedy tokens from the cache-free forward, recomputed over a fixed-size buffer for every new token (one
    compilation). Causality makes the logits at a position independent of the padding after it."""
    import jax
    from flax import nnx

    buffer = np.zeros((len(prompts), max(map(len, prompts)) + max_new_tokens), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for row, prompt in enumerate(prompts):
        buffer[row, : len(prompt)] = prompt
    graphdef, state = nnx.split(model)
    last_logits = jax.jit(lambda state, ids, lengths: nnx.merge(graphdef, state)(ids)[np.arange(len(prompts)),
                                                                                      lengths - 1])
    for _ in range(max_new_tokens):
        buffer[np.arange(len(prompts)), lengths] = np.asarray(last_logits(state, buffer, lengths)).argmax(-1)
        lengths += 1
    return [buffer[row, len(p):lengths[row]].tolist() for row, p in enumerate(prompts)]


@pytest.fixture(scope="module", params=["dense", "moe"])
def served(request, tmp_path_factory):
    hf_model = make_nemotron_h(request.param)
    path = save(hf_model, tmp_path_factory.mktemp(request.param))
    # Its buckets before serving and nothing else: the default warm-up would go on to compile samplers for sampled
    # and logit-adjusting requests, which these greedy tests never make (the `dense` engine tests the default).
    return hf_model, path, jaxmodels.LLM(path, dtype="float32", **{**LIMITS, "warmup": "all"})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    hf_model = make_nemotron_h("dense")
    path = save(hf_model, tmp_path_factory.mktemp("dense_engine"))
    return hf_model, path, jaxmodels.LLM(path, dtype="float32", **LIMITS)


def test_greedy_matches_transformers(served):
    hf_model, _, llm = served
    prompts = random_prompts(PROMPT_LENGTHS)
    outs = llm.generate(prompts, GREEDY)
    assert [o.index for o in outs] == list(range(len(prompts)))
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(hf_model, prompt)
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == ("stop" if expected[-1] == 2 and len(expected) < NEW_TOKENS else "length")
        assert out.prompt_token_ids == prompt


@pytest.mark.parametrize("variant", ["deepseek_v32", "deepseek_v32_yarn", "glm_moe_dsa"])
def test_dsa_greedy_matches_transformers(variant, tmp_path):
    """DSA models through the same engine. index_topk is 6 in these checkpoints, so every prompt longer than that
    attends sparsely, through keys its indexer picked from the paged index-key cache."""
    hf_model = make_dsa(variant)
    path = save(hf_model, tmp_path / variant)
    llm = jaxmodels.LLM(path, dtype="float32", **{**LIMITS, "warmup": False})
    prompts = random_prompts(PROMPT_LENGTHS, vocab=hf_model.config.vocab_size)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"


def test_dsa_selecting_every_key_matches_transformers(tmp_path):
    """index_topk at the engine's whole row (64 positions): each query selects every key it sees, which the indexer
    lists without scoring them and the sparse attention walks only as far as that (`listed`)."""
    hf_model = make_dsa("deepseek_v32", index_topk=LIMITS["max_seq_len"])
    llm = jaxmodels.LLM(save(hf_model, tmp_path / "all_keys"), dtype="float32", **{**LIMITS, "warmup": False})
    prompts = random_prompts(PROMPT_LENGTHS, vocab=hf_model.config.vocab_size)
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY)):
        assert out.token_ids == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"


def test_dsa_fp8_index_keys_serve_the_model_forward(tmp_path):
    """`reference` indexer numerics (Hadamard + FP8 index keys with per-token scales in the paged cache): the engine
    gives the tokens of the no-cache forward with the same numerics (transformers has no FP8 path to compare with)."""
    import json

    path = save(make_dsa("deepseek_v32"), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "indexer_numerics": "reference"}))
    llm = jaxmodels.LLM(path, dtype="float32", **{**LIMITS, "warmup": False})
    assert any(cache.index_k_scale is not None for cache in llm.engine.runner.caches)
    prompts = random_prompts(PROMPT_LENGTHS, vocab=101)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expected = greedy_by_full_forward(llm.model, prompts, params.max_new_tokens)
    for prompt, out, want in zip(prompts, llm.generate(prompts, params), expected):
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"



def test_request_alone_equals_request_in_padded_batches(dense):
    _, _, llm = dense
    target = random_prompts([13], seed=1)[0]
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    for params in (GREEDY, sampled):
        alone = llm.generate([target], params)[0].token_ids
        # Three requests pad the decode batch to 4 and the prefill chunks to their bucket; others differ in length.
        for others in ([2, 20], [30, 5], [1]):
            batch = random_prompts(others, seed=len(others) + others[0])
            mixed = llm.generate([*batch[:1], target, *batch[1:]], params)
            assert mixed[1].token_ids == alone


@contextlib.contextmanager
def count_compilations():
    """Counts XLA compilations on the step path: all but the warm-up's own (engine.warmup compiles on threads named
    jaxmodels-xla, also in the background while the engine serves)."""
    import threading

    from jax._src import monitoring

    count = [0]

    def listener(event, duration_secs, **kwargs):
        if (event == "/jax/core/compile/backend_compile_duration"
                and not threading.current_thread().name.startswith("jaxmodels-xla")):
            count[0] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        monitoring.unregister_event_duration_listener(listener)


def test_nothing_compiles_on_the_step_path(dense):
    import jax

    _, _, llm = dense
    with count_compilations() as count:
        jax.jit(lambda x: x * 3 + 1)(np.arange(5))  # the listener does see compilations
    assert count[0] >= 1
    with count_compilations() as count:
        llm.generate(random_prompts([27, 1, 9, 16, 4, 22, 2], seed=5), GREEDY)
        llm.generate(random_prompts([5], seed=6), SamplingParams(max_new_tokens=3, temperature=1.3, seed=9))
        params = [SamplingParams(max_new_tokens=n, temperature=t, top_k=k, top_p=p, seed=n)
                  for n, t, k, p in [(1, 0.0, 0, 1.0), (6, 0.7, 5, 0.8), (12, 1.0, 0, 0.5)]]
        for out in llm.generate_stream(random_prompts([40, 7, 12], seed=7), params):
            pass
    assert count[0] == 0


def test_preemption_completes_every_request(tmp_path):
    hf_model = make_nemotron_h("dense")
    path = save(hf_model, tmp_path / "ckpt")
    # 8 usable pages of 8 tokens hold 64 tokens; five requests need about 5 x 35.
    llm = jaxmodels.LLM(path, dtype="float32", max_batch_size=4, max_seq_len=64, max_prefill_tokens=8,
                        page_size=8, num_pages=9, warmup=False, progress=False)
    prompts = random_prompts([20, 25, 12, 27, 18], seed=3)
    params = SamplingParams(max_new_tokens=15, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        assert len(out.token_ids) == 15
        expected = hf_greedy(hf_model, prompt, 15)
        assert out.token_ids[: len(expected)] == expected
    # Everything given back: no page or slot held by a request, and the prefix cache returns its pages when asked.
    (scheduler,) = llm.engine.scheduler.groups  # one dp group
    # (Slots may keep the state of what their last request computed, for the prefix cache: free all the same.)
    assert scheduler._free_count() == 8 and scheduler._free_slot_count() == 4 and not scheduler.has_work()
    llm.engine.clear_prefix_cache()
    assert len(scheduler.free_pages) == 8 and len(scheduler.free_slots) == 4


def test_bad_input_is_rejected_and_others_finish(dense):
    hf_model, _, llm = dense
    good = random_prompts([6, 11], seed=4)
    prompts = [good[0], [], list(range(3, 67)), [5, 97], [5, -1], good[1], good[1], good[1], good[1], good[1]]
    params = [GREEDY] * 6 + [SamplingParams(max_new_tokens=0), SamplingParams(temperature=-1.0),
                             SamplingParams(top_p=0.0), SamplingParams(top_k=-5)]
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    errors = {o.index: o.error for o in outs if o.finish_reason == "error"}
    assert set(errors) == {1, 2, 3, 4, 6, 7, 8, 9}
    assert "empty" in errors[1]
    assert "max_seq_len=64" in errors[2]
    assert "97" in errors[3] and "vocabulary" in errors[3]
    assert "-1" in errors[4] and "vocabulary" in errors[4]
    assert "max_new_tokens" in errors[6]
    assert "temperature" in errors[7]
    assert "top_p" in errors[8]
    assert "top_k" in errors[9]
    assert outs[0].token_ids == hf_greedy(hf_model, good[0])
    assert outs[5].token_ids == hf_greedy(hf_model, good[1])
    # The engine holds nothing of the rejected requests.
    assert not llm.engine.has_work()


def test_text_prompt_without_tokenizer_is_an_error(dense):
    _, _, llm = dense
    (out,) = llm.generate(["hello"], GREEDY)
    assert out.finish_reason == "error" and "tokenizer" in out.error


def test_streaming_yields_every_token_then_the_final_output(dense):
    _, _, llm = dense
    prompts = random_prompts([4, 15], seed=8)
    final = llm.generate(prompts, GREEDY)
    seen = {0: [], 1: []}
    for out in llm.generate_stream(prompts, GREEDY):
        assert out.token_ids[:-1] == seen[out.index]  # one new token per update
        seen[out.index] = out.token_ids
        if out.finished:
            assert out.token_ids == final[out.index].token_ids
    assert [seen[0], seen[1]] == [o.token_ids for o in final]


def test_text_prompts_use_the_checkpoint_tokenizer(dense, tmp_path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_model, path, _ = dense
    vocab = {f"w{i}": i for i in range(97)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory = shutil.copytree(path, tmp_path / "with_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    llm = jaxmodels.LLM(directory, dtype="float32", max_batch_size=1, max_seq_len=32, max_prefill_tokens=8,
                        warmup=False, progress=False)
    (out,) = llm.generate(["w5 w17 w40 w8"], GREEDY)
    assert out.prompt_token_ids == [5, 17, 40, 8]
    assert out.token_ids == hf_greedy(hf_model, [5, 17, 40, 8])
    assert out.text == tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("launch_thread", [False, None])
def test_overlapped_loop_gives_the_plain_loops_tokens(tmp_path, launch_thread):
    """Overlap schedules step N+1 before step N's tokens are read (and with a launch thread, the default in one
    process, sends it from another thread while this one reads step N): outputs must not change, with stop tokens
    that end requests mid-flight and a pool small enough to force preemptions."""
    path = save(make_nemotron_h("dense"), tmp_path / "ckpt")
    limits = dict(dtype="float32", max_batch_size=4, max_seq_len=64, max_prefill_tokens=8, page_size=8, num_pages=9,
                  warmup=False, progress=False)
    plain = jaxmodels.LLM(path, overlap=False, **limits)
    launch = {} if launch_thread is None else dict(launch_thread=launch_thread)
    overlapped = jaxmodels.LLM(path, overlap=True, **launch, **limits)
    runner, threads = overlapped.engine.runner, set()

    def run_recording_thread(*args, run=runner._run):
        threads.add(threading.current_thread().name)
        return run(*args)

    runner._run = run_recording_thread
    prompts = random_prompts([20, 25, 12, 27, 18, 3], seed=3)
    free_run = plain.generate(prompts, SamplingParams(max_new_tokens=15, temperature=0.0, ignore_eos=True))
    # Stop tokens that end some requests after a few tokens, while their next step is already in flight.
    stops = tuple({free_run[0].token_ids[3], free_run[4].token_ids[6]})
    params = [SamplingParams(max_new_tokens=15, temperature=0.0, ignore_eos=True, stop_token_ids=stops),
              SamplingParams(max_new_tokens=12, temperature=0.8, top_k=10, seed=7, stop_token_ids=stops)] * 3
    expected = plain.generate(prompts, params)
    got = overlapped.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert "stop" in {o.finish_reason for o in got}
    assert overlapped.engine.scheduler.num_preemptions > 0
    assert threads == ({threading.main_thread().name} if launch_thread is False else {"jaxmodels-launch_0"})


def test_abort_frees_the_slot_and_pages_and_others_finish(dense):
    _, _, llm = dense
    engine = llm.engine
    prompts = random_prompts([9, 14, 5], seed=11)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    alone = llm.generate([prompts[0], prompts[2]], params)
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    engine.abort(requests[1].request_id)
    finished = {}
    while engine.has_work():
        for request in engine.step():
            if request.finished:
                finished[request.request_id] = request
    assert finished[requests[1].request_id].finish_reason == "abort"
    assert [finished[r.request_id].output for r in (requests[0], requests[2])] == [o.token_ids for o in alone]
    metrics = llm.metrics()
    assert (metrics["running"], metrics["waiting"], metrics["slots_used"], metrics["kv_pages_used"]) == (0, 0, 0, 0)


def test_metrics_report_host_and_wall_time_per_step(dense):
    _, _, llm = dense
    llm.engine.reset_metrics()
    outs = llm.generate(random_prompts([6, 10], seed=12), GREEDY)
    metrics = llm.metrics()
    assert metrics["steps"] == metrics["extend_steps"] + metrics["decode_steps"] > 0
    assert 0 < metrics["host_s_per_step"] <= metrics["wall_s_per_step"]
    assert metrics["generated_tokens"] == sum(len(o.token_ids) for o in outs)
