"""The server through the official `openai` client: completions and chat, streamed and not, against LLM.generate."""

import asyncio

import httpx
import pytest

from jaxmodels import SamplingParams
from tests.serve.conftest import MODEL

PROMPT = "Hello world, how are you today?"
REPLACEMENT = "\ufffd"
RETURN_IDS = {"return_token_ids": True}


def greedy(reference, prompt, max_new_tokens, **params):
    (out,) = reference.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **params))
    return out


def test_greedy_completion_equals_llm_generate(server, reference):
    expected = greedy(reference, PROMPT, 24)
    out = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body=RETURN_IDS)
    (choice,) = out.choices
    assert choice.token_ids == expected.token_ids
    assert choice.prompt_token_ids == expected.prompt_token_ids
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(expected.prompt_token_ids), len(expected.token_ids),
        len(expected.prompt_token_ids) + len(expected.token_ids))


def test_streamed_chunks_concatenate_to_the_same_text(server, reference):
    expected = greedy(reference, PROMPT, 40, ignore_eos=True)
    # The output holds tokens that are part of a character, so the stream must hold text back somewhere.
    assert any(REPLACEMENT in server.tokenizer.decode([t]) for t in expected.token_ids)
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                                   stream=True, extra_body={**RETURN_IDS, "ignore_eos": True}))
    assert len(chunks) > 1
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == expected.token_ids
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40


def test_stream_with_include_usage_ends_with_a_usage_chunk(server):
    chunks = list(server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_prompt_lists(server, reference):
    prompts = [[5, 6, 7, 8], [40, 41]]
    expected = reference.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    out = server.client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                           extra_body=RETURN_IDS)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.token_ids for c in out.choices] == [e.token_ids for e in expected]
    assert out.usage.prompt_tokens == 6


def test_n_choices_draw_with_seed_plus_index(server):
    def sampled(**kwargs):
        out = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                               extra_body={**RETURN_IDS, "ignore_eos": True}, **kwargs)
        return [c.token_ids for c in sorted(out.choices, key=lambda c: c.index)]

    together = sampled(n=3, seed=7)
    apart = [sampled(seed=7 + i)[0] for i in range(3)]
    assert together == apart
    assert len({tuple(t) for t in apart}) == 3  # the seeds really differ


def spanning_stop(tokenizer, token_ids) -> tuple[str, int]:
    """A stop string made of the last character of one token's text and the first of the next one's, at the first
    token boundary where it does not occur earlier; and where it begins in the text."""
    texts = [tokenizer.decode(token_ids[:k]) for k in range(len(token_ids) + 1)]
    for k in range(1, len(token_ids)):
        before, this, after = texts[k - 1], texts[k], texts[k + 1]
        if not (after.startswith(this) and len(this) > len(before) and len(after) > len(this)):
            continue  # a token without text of its own, or an unfinished character
        stop = this[-1] + after[len(this)]
        if stop.isprintable() and REPLACEMENT not in stop and after.find(stop) == len(this) - 1:
            return stop, len(this) - 1
    raise AssertionError("no two neighbouring tokens with printable text")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_spanning_two_tokens_ends_the_text_before_it(server, reference, stream):
    full = greedy(reference, PROMPT, 60, ignore_eos=True)
    stop, start = spanning_stop(server.tokenizer, full.token_ids)
    # "zz~" never occurs; it checks that several stop strings are matched together.
    out = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0,
                                           stop=["zz~", stop], stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(out)
        text, finish_reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish_reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == full.text[:start]
    assert finish_reason == "stop"


def test_stop_token_ids_end_the_output_at_the_token(server, reference):
    full = greedy(reference, PROMPT, 20, ignore_eos=True)
    stop_id = full.token_ids[6]
    out = server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                           extra_body={**RETURN_IDS, "ignore_eos": True,
                                                       "stop_token_ids": [stop_id]})
    assert out.choices[0].token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert out.choices[0].finish_reason == "stop"


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Un café, s'il vous plaît 🙂"}]


def test_chat_prompt_is_the_one_transformers_renders(server, reference):
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(server.path).apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = greedy(reference, prompt["input_ids"], 12)
    out = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                extra_body=RETURN_IDS)
    assert out.prompt_token_ids == prompt["input_ids"]
    assert out.usage.prompt_tokens == len(prompt["input_ids"])
    assert out.choices[0].token_ids == expected.token_ids
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.role == "assistant"


def test_streamed_chat_opens_with_the_role_and_carries_the_same_content(server):
    whole = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_32_concurrent_streams_all_finish_with_their_tokens(server, reference):
    import openai

    prompts = [[3 + (7 * i + j) % 300 for j in range(1 + i % 13)] for i in range(32)]
    expected = reference.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body=RETURN_IDS)
        ids, text, finish_reason = [], "", None
        async for chunk in stream:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason
        return ids, text, finish_reason

    async def all_of_them():
        async with client:
            return await asyncio.gather(*(one(p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert [g[0] for g in got] == [e.token_ids for e in expected]
    assert [g[1] for g in got] == [e.text for e in expected]
    assert [g[2] for g in got] == [e.finish_reason for e in expected]


def test_models_lists_the_served_model(server):
    (model,) = server.client.models.list().data
    assert model.id == MODEL
    assert server.client.models.retrieve(MODEL).id == MODEL


def test_health_is_ok(server):
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "buckets_compiling": 0}  # one bucket of each kind, compiled


def test_metrics_are_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ["requests_running", "requests_waiting", "generation_tokens_per_second", "kv_cache_usage",
                 "slots_used", "slots_total", "kv_pages_used", "kv_pages_total"]:
        assert families[f"jaxmodels_{name}"].type == "gauge", name
    assert families["jaxmodels_generation_tokens"].type == "counter"
    assert families["jaxmodels_generation_tokens"].samples[0].value >= 3
    assert families["jaxmodels_generation_tokens_per_second"].samples[0].value > 0
    assert families["jaxmodels_slots_total"].samples[0].value == 8
    assert families["jaxmodels_ready_seconds"].samples[0].value > 0
    assert families["jaxmodels_buckets_ready"].samples[0].value == 2  # one prefill and one decode bucket
    assert families["jaxmodels_buckets_compiling"].samples[0].value == 0
    # A 40-token prompt twice: the second finds the first's two full pages (and the state snapshot after them).
    hits = families["jaxmodels_prefix_cache_hit_tokens"].samples[0].value
    for _ in range(2):
        server.client.completions.create(model=MODEL, prompt=list(range(3, 43)), max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    assert families["jaxmodels_prefix_cache_prompt_tokens"].type == "counter"
    assert families["jaxmodels_prefix_cache_hit_tokens"].samples[0].value - hits >= 32
    for name in ["prefix_cache_pages", "prefix_cache_idle_pages", "prefix_cache_snapshots"]:
        assert families[f"jaxmodels_{name}"].type == "gauge", name


def test_tokenize_gives_the_prompts_the_generation_routes_use(server):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(server.path)
    chat = httpx.post(f"{server.url}/v1/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert chat["tokens"] == expected and chat["count"] == len(expected) and chat["max_model_len"] == 2048
    out = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, extra_body=RETURN_IDS)
    assert out.prompt_token_ids == chat["tokens"]
    text = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert text["tokens"] == server.tokenizer.encode(PROMPT).ids
    assert text["token_strs"] == [hf.convert_ids_to_tokens(t) for t in text["tokens"]]
    back = httpx.post(f"{server.url}/v1/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json()
    assert back == {"prompt": hf.decode(chat["tokens"])}


def test_tokenize_errors_name_the_field(server):
    both = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": "a", "messages": MESSAGES})
    assert both.status_code == 400 and "exactly one of prompt and messages" in both.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/detokenize", json={"tokens": [5, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(f"{server.url}/v1/detokenize", json={"model": "other", "tokens": [5]})
    assert other.status_code == 404
