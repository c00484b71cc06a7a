"""Penalties, logit_bias, min_tokens and logprobs through the real server and the `openai` client.

The expected values come from transformers' float32 logits of the served checkpoint, adjusted by the engine tests'
numpy reference (`reference_adjust`), teacher-forced on the served tokens: a greedy output is right when each of its
tokens is the argmax of its row, and its logprobs when they are the rows' log_softmax.
"""

import httpx
import numpy as np
import pytest
import torch

import jaxmodels
from tests.engine.test_sampling_controls import reference_adjust
from tests.serve.conftest import LIMITS, MODEL
from tests.serve.test_server import PROMPT, REPLACEMENT, spanning_stop

EOS = 1  # the served checkpoint's end-of-sequence token
MESSAGES = [{"role": "user", "content": "Un café, s'il vous plaît 🙂"}]


@pytest.fixture(scope="module")
def hf_model(served_checkpoint):
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM.from_pretrained(served_checkpoint, torch_dtype=torch.float32).eval()


def reference_rows(hf_model, prompt, output, *, eos=EOS, **adjustments) -> list[np.ndarray]:
    """Per output position, the log_softmax of transformers' logits adjusted as the request asks
    (reference_adjust's keywords), given the tokens before it."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].double().numpy()
    rows = [reference_adjust(row, prompt=prompt, output=output[:i], stops=(eos,), **adjustments)
            for i, row in enumerate(logits)]
    return [row - np.logaddexp.reduce(row) for row in rows]


def token_string(server, token: int) -> str:
    return server.tokenizer.decode([token], skip_special_tokens=False)


def completion(server, **body):
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body}
    extra = {"return_token_ids": True, **body.pop("extra_body", {})}
    return server.client.completions.create(**body, extra_body=extra)


def chat(server, **body):
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, **body}
    extra = {"return_token_ids": True, **body.pop("extra_body", {})}
    return server.client.chat.completions.create(**body, extra_body=extra)


# --- logprobs against the reference --------------------------------------------------------------------------------

def test_completion_logprobs_are_the_models(server, hf_model):
    out = completion(server, max_tokens=24, logprobs=5, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    tokens, logprobs = choice.token_ids, choice.logprobs
    rows = reference_rows(hf_model, choice.prompt_token_ids, tokens)
    assert len(logprobs.tokens) == len(tokens) == out.usage.completion_tokens == 24
    assert logprobs.tokens == [token_string(server, t) for t in tokens]
    for token, row, logprob, top in zip(tokens, rows, logprobs.token_logprobs, logprobs.top_logprobs):
        assert token == row.argmax()
        assert abs(logprob - row[token]) < 1e-4
        expected = {}
        for t in np.argsort(-row)[:5]:  # the 5 most likely; two tokens of one string keep the likelier
            expected.setdefault(token_string(server, t), row[t])
        assert list(top) == list(expected)
        np.testing.assert_allclose(list(top.values()), list(expected.values()), atol=1e-4)


def test_completion_text_offsets_point_at_each_tokens_text(server):
    out = completion(server, max_tokens=40, logprobs=0, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    offsets, strings = choice.logprobs.text_offset, choice.logprobs.tokens
    assert choice.logprobs.top_logprobs is None  # k = 0
    assert any(REPLACEMENT in s for s in strings)  # some tokens are part of a character
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice.text)
    # A token that is whole text and follows whole text starts where its text is; the others (bytes of a
    # character, or what follows them in the text that completes it) point where that text starts.
    checked = 0
    for previous, offset, string in zip([""] + strings, offsets, strings):
        if REPLACEMENT not in previous + string:
            assert choice.text.startswith(string, offset)
            checked += 1
    assert checked >= len(strings) // 4


def test_chat_logprobs_are_the_models_with_their_bytes(server, hf_model):
    out = chat(server, max_tokens=30, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    rows = reference_rows(hf_model, out.prompt_token_ids, choice.token_ids)
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids) == out.usage.completion_tokens
    for token, row, entry in zip(choice.token_ids, rows, content):
        assert token == row.argmax()
        assert entry.token == token_string(server, token)
        assert abs(entry.logprob - row[token]) < 1e-4
        top_ids = np.argsort(-row)[:4]
        assert [e.token for e in entry.top_logprobs] == [token_string(server, t) for t in top_ids]
        np.testing.assert_allclose([e.logprob for e in entry.top_logprobs], row[top_ids], atol=1e-4)
    # Byte-level BPE: the tokens' bytes are exact, half characters included, so they make up the text (where the
    # random model wrote invalid UTF-8, both decode it to U+FFFD).
    assert any(REPLACEMENT in entry.token and bytes(entry.bytes) != entry.token.encode() for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == choice.message.content


def test_chat_without_top_logprobs_gives_empty_lists(server):
    out = chat(server, max_tokens=4, logprobs=True)
    assert [entry.top_logprobs for entry in out.choices[0].logprobs.content] == [[]] * 4
    plain = chat(server, max_tokens=4)
    assert plain.choices[0].logprobs is None


# --- streamed logprobs ---------------------------------------------------------------------------------------------

def completion_lists(logprobs) -> dict:
    return {"tokens": logprobs.tokens, "token_logprobs": logprobs.token_logprobs,
            "top_logprobs": logprobs.top_logprobs, "text_offset": logprobs.text_offset}


@pytest.mark.parametrize("with_stop", [False, True], ids=["to_the_length", "cut_by_a_stop_string"])
def test_streamed_completion_logprobs_concatenate_to_the_whole(server, with_stop):
    body = dict(max_tokens=40, logprobs=3, extra_body={"ignore_eos": True})
    if with_stop:  # a stop string over two tokens: the first one's text is held back until the second comes
        plain = completion(server, max_tokens=40, extra_body={"ignore_eos": True}).choices[0]
        body["stop"] = [spanning_stop(server.tokenizer, plain.token_ids)[0]]
    whole = completion(server, **body)
    chunks = list(completion(server, **body, stream=True))
    expected = completion_lists(whole.choices[0].logprobs)
    assert len(expected["tokens"]) == whole.usage.completion_tokens
    streamed = {key: [] for key in expected}
    for chunk in chunks:
        for key, values in completion_lists(chunk.choices[0].logprobs).items():
            streamed[key] += values
    assert streamed == expected
    assert sum((c.choices[0].token_ids for c in chunks), []) == whole.choices[0].token_ids
    assert whole.choices[0].finish_reason == ("stop" if with_stop else "length")


def test_streamed_chat_logprobs_concatenate_to_the_whole(server):
    body = dict(max_tokens=40, logprobs=True, top_logprobs=2, n=2, temperature=1.0, seed=3,
                extra_body={"ignore_eos": True})
    whole = chat(server, **body)
    chunks = list(chat(server, **body, stream=True))
    for choice in whole.choices:
        streamed = [entry.model_dump() for chunk in chunks for c in chunk.choices if c.index == choice.index
                    and c.logprobs is not None for entry in c.logprobs.content]
        assert streamed == [entry.model_dump() for entry in choice.logprobs.content]
        assert len(streamed) == 40


def test_held_back_text_keeps_logprobs_in_order_through_the_parsers():
    """DeepSeek-V3.2's output (reasoning, content, DSML tool calls: tags the parsers hold back) arriving in uneven
    batches: each delta carries its own tokens' logprobs, all of them once, in order; the stream's chunks and the
    whole body list the same."""
    from jaxmodels.serve.generation import Choice, OutputParsers, _ChoiceText
    from jaxmodels.serve.responses import ChatResponses, TokenStrings
    from tests.serve.test_chat_reasoning_tools import DSV32, DSV32_OUTPUT, TOOLS, build_tokenizer

    tokenizer = build_tokenizer(DSV32)
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    token_ids = tokenizer.encode(DSV32_OUTPUT, add_special_tokens=False).ids + [eos]
    logprobs = [(-0.5 * i, [(token, -0.5 * i)]) for i, token in enumerate(token_ids)]
    parsers = OutputParsers.choose("deepseek_v32", None)
    offsets = None
    for batch in (1, 2, 3, 7):
        choice = _ChoiceText(0, tokenizer, [], parsers.chat_output("<think>", tools=TOOLS, read_tool_calls=True),
                             logprobs=True)
        starts = range(0, len(token_ids), batch)
        deltas = [choice.add(token_ids[i:i + batch], "stop" if i + batch >= len(token_ids) else None,
                             logprobs[i:i + batch]) for i in starts]
        deltas = [d for d in deltas if d is not None]
        assert len(deltas) < len(starts)  # some text was held back
        for delta in deltas:
            assert [e.token for e in delta.logprobs] == delta.token_ids
        entries = [e for d in deltas for e in d.logprobs]
        assert [(e.token, e.logprob, e.top) for e in entries] == [(t, lp, top) for t, (lp, top)
                                                                 in zip(token_ids, logprobs)]
        assert offsets in (None, [e.text_offset for e in entries])  # whatever the batches
        offsets = [e.text_offset for e in entries]
        responses = ChatResponses(MODEL, return_token_ids=False, parsed=True, reasoning=True,
                                  token_strings=TokenStrings(tokenizer))
        body = responses.body([Choice(0, parts=[p for d in deltas for p in d.parts], logprobs=entries)], [], {})
        chunks = [chunk for d in deltas for chunk in responses.chunks(d)]
        streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
        assert streamed == body["choices"][0]["logprobs"]["content"]
        assert body["choices"][0]["message"]["tool_calls"]  # the parsers did read the output


@pytest.mark.parametrize("logprobs", [False, True], ids=["text", "with_logprobs"])
def test_a_stop_string_ends_the_tokens_at_the_one_completing_it_whatever_the_batches(logprobs):
    """The engine may hand over several tokens at once (a step's worth, or the event loop's backlog): the choice's
    tokens, logprobs and count end at the token whose text completes the stop string in every batching."""
    from jaxmodels.serve.generation import _ChoiceText
    from tests.serve.checkpoint import byte_level_tokenizer
    from tests.serve.test_server import spanning_stop

    tokenizer = byte_level_tokenizer()
    token_ids = tokenizer.encode("Hello world! How are you today? The quick brown fox.").ids
    stop, start = spanning_stop(tokenizer, token_ids)
    ends_at = next(k for k in range(1, len(token_ids) + 1) if stop in tokenizer.decode(token_ids[:k]))
    assert ends_at < len(token_ids) - 2  # tokens follow the stop: a batch can hold them
    scores = [(-0.25 * i, [(token, -0.25 * i)]) for i, token in enumerate(token_ids)]
    for batch in (1, 2, 3, len(token_ids)):
        choice = _ChoiceText(0, tokenizer, [stop], logprobs=logprobs)
        deltas = []
        for i in range(0, len(token_ids), batch):
            if choice.finish_reason is None:  # as Generation.deltas: what comes after the end is dropped
                deltas.append(choice.add(token_ids[i:i + batch], None, scores[i:i + batch] if logprobs else None))
        deltas = [d for d in deltas if d is not None]
        assert [t for d in deltas for t in d.token_ids] == token_ids[:ends_at]
        assert choice.num_tokens == ends_at and deltas[-1].finish_reason == "stop"
        assert "".join(d.text for d in deltas) == tokenizer.decode(token_ids)[:start]
        if logprobs:
            assert [(e.token, e.logprob) for d in deltas for e in d.logprobs] == [
                (t, lp) for t, (lp, _) in zip(token_ids[:ends_at], scores)]


# --- the adjustments -----------------------------------------------------------------------------------------------

def test_a_strong_logit_bias_forces_a_token(server):
    forced = 57
    out = completion(server, max_tokens=6, logit_bias={str(forced): 100})
    assert out.choices[0].token_ids == [forced] * 6
    reply = chat(server, max_tokens=3, logit_bias={str(forced): 100})
    assert reply.choices[0].token_ids == [forced] * 3


def test_min_tokens_keeps_a_likely_eos_back(server, hf_model):
    bias = {EOS: 100.0}
    out = completion(server, max_tokens=8, logit_bias={str(EOS): 100}, logprobs=2, extra_body={"min_tokens": 3})
    (choice,) = out.choices
    assert EOS not in choice.token_ids[:3] and choice.token_ids[3:] == [EOS]
    assert choice.finish_reason == "stop"
    rows = reference_rows(hf_model, choice.prompt_token_ids, choice.token_ids, bias=bias, min_tokens=3)
    assert choice.token_ids == [int(row.argmax()) for row in rows]
    np.testing.assert_allclose(choice.logprobs.token_logprobs, [row[t] for t, row in zip(choice.token_ids, rows)],
                               atol=1e-4)
    assert abs(choice.logprobs.token_logprobs[3]) < 1e-4  # biased by 100, EOS is all but certain
    unheld = completion(server, max_tokens=8, logit_bias={str(EOS): 100})
    assert unheld.choices[0].token_ids == [EOS]


@pytest.mark.parametrize("fields, adjustments", [
    ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition": 1.8}),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.7}, {"presence": 1.5, "frequency": 0.7}),
], ids=["repetition", "presence_and_frequency"])
def test_penalties_change_greedy_output_as_the_reference_does(server, hf_model, fields, adjustments):
    plain = completion(server, max_tokens=16, extra_body={"ignore_eos": True}).choices[0]
    fields = {**fields, "extra_body": {"ignore_eos": True, **fields.get("extra_body", {})}}
    penalized = completion(server, max_tokens=16, **fields).choices[0]
    assert penalized.token_ids != plain.token_ids
    rows = reference_rows(hf_model, penalized.prompt_token_ids, penalized.token_ids, **adjustments)
    assert penalized.token_ids == [int(row.argmax()) for row in rows]
    streamed = list(completion(server, max_tokens=16, stream=True, **fields))
    assert sum((c.choices[0].token_ids for c in streamed), []) == penalized.token_ids


def test_usage_is_unchanged_by_logprobs(server):
    plain = completion(server, max_tokens=5, extra_body={"ignore_eos": True})
    with_logprobs = completion(server, max_tokens=5, logprobs=20, extra_body={"ignore_eos": True})
    assert with_logprobs.usage == plain.usage
    assert len(with_logprobs.choices[0].logprobs.tokens) == 5
    # A dict keyed by string: the byte tokens that all read U+FFFD share one key.
    assert all(1 <= len(top) <= 21 for top in with_logprobs.choices[0].logprobs.top_logprobs)
    plain, with_logprobs = chat(server, max_tokens=5), chat(server, max_tokens=5, logprobs=True, top_logprobs=20)
    assert with_logprobs.usage == plain.usage
    assert [len(entry.top_logprobs) for entry in with_logprobs.choices[0].logprobs.content] == [20] * 5


# --- bad values ----------------------------------------------------------------------------------------------------

# (endpoint, body beside the prompt or messages, the param its 400 names)
BAD_VALUES = {
    "presence_penalty_high": ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    "frequency_penalty_low": ("chat/completions", {"frequency_penalty": -2.1}, "frequency_penalty"),
    "frequency_penalty_text": ("completions", {"frequency_penalty": "high"}, "frequency_penalty"),
    "repetition_penalty_zero": ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    "repetition_penalty_high": ("chat/completions", {"repetition_penalty": 2.5}, "repetition_penalty"),
    "min_tokens_negative": ("completions", {"min_tokens": -1}, "min_tokens"),
    "min_tokens_float": ("completions", {"min_tokens": 1.5}, "min_tokens"),
    "min_tokens_past_max_tokens": ("completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    "logit_bias_list": ("completions", {"logit_bias": [5, 6]}, "logit_bias"),
    "logit_bias_key_not_an_id": ("completions", {"logit_bias": {"fox": 1}}, "logit_bias"),
    "logit_bias_negative_key": ("chat/completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
    "logit_bias_value_high": ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    "logit_bias_value_text": ("completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
    "logit_bias_outside_vocab": ("chat/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    "logit_bias_too_many": ("completions", {"logit_bias": {str(t): 1 for t in range(129)}}, "logit_bias"),
    "logprobs_high": ("completions", {"logprobs": 21}, "logprobs"),
    "logprobs_negative": ("completions", {"logprobs": -1}, "logprobs"),
    "logprobs_bool_for_completions": ("completions", {"logprobs": True}, "logprobs"),
    "logprobs_int_for_chat": ("chat/completions", {"logprobs": 2}, "logprobs"),
    "top_logprobs_without_logprobs": ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    "top_logprobs_with_logprobs_false": ("chat/completions", {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    "top_logprobs_high": ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs_on_completions": ("completions", {"top_logprobs": 2}, "top_logprobs"),
}


def post(url, endpoint, body) -> httpx.Response:
    base = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    return httpx.post(f"{url}/v1/{endpoint}", json={"model": MODEL, **base, "max_tokens": 8, **body}, timeout=120)


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_get_a_400_naming_the_field(server, case):
    endpoint, body, param = BAD_VALUES[case]
    response = post(server.url, endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"], error


def test_neutral_values_are_accepted(server):
    """The values clients send by default: top_logprobs 0 without logprobs (as before they were served)."""
    for endpoint, body in [("chat/completions", {"top_logprobs": 0, "logprobs": False, "logit_bias": {}}),
                           ("completions", {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                                            "repetition_penalty": 1, "min_tokens": 0})]:
        response = post(server.url, endpoint, body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["logprobs"] is None


@pytest.fixture(scope="module")
def speculative_server(served_checkpoint):
    """A server whose engine says it drafts tokens (it has no MTP layers: only refusals are asked of it)."""
    from jaxmodels.serve.app import build_app
    from jaxmodels.serve.server import BackgroundServer

    llm = jaxmodels.LLM(served_checkpoint, **{**LIMITS, "warmup": False})
    llm.engine.num_speculative_tokens = 2
    with BackgroundServer(build_app(llm, model_name=MODEL)) as background:
        yield background.url


@pytest.mark.parametrize("endpoint, body, param", [
    ("completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {"min_tokens": 2}, "min_tokens"),
    ("completions", {"logit_bias": {"5": 3}}, "logit_bias"),
    ("completions", {"logprobs": 0}, "logprobs"),
    ("chat/completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("chat/completions", {"logprobs": True}, "logprobs"),
])
def test_a_speculative_engine_refuses_them_with_a_400(speculative_server, endpoint, body, param):
    response = post(speculative_server, endpoint, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "speculative" in error["message"], error


def test_the_engines_own_refusal_of_a_speculative_request_is_a_400(served_checkpoint):
    """Past the server's check (a ticket queued directly), the engine's InvalidRequest is a 400 Rejection, not a
    500."""
    import asyncio

    from jaxmodels import SamplingParams
    from jaxmodels.serve.generation import Generation, Rejection
    from jaxmodels.serve.metrics import ServerStats
    from jaxmodels.serve.worker import EngineWorker

    llm = jaxmodels.LLM(served_checkpoint, **{**LIMITS, "warmup": False})
    llm.engine.num_speculative_tokens = 2

    async def submit():
        worker = EngineWorker(llm.engine, asyncio.get_running_loop())
        worker.start()
        try:
            generation = Generation(worker, ServerStats(), [([5, 6], SamplingParams(logprobs=2))], tokenizer=None,
                                    stops=[])
            with pytest.raises(Rejection) as refused:
                await generation.submit()
            return refused.value
        finally:
            await asyncio.to_thread(worker.stop)

    refusal = asyncio.run(submit())
    assert refusal.status == 400 and "speculative" in refusal.message
    llm.close()
