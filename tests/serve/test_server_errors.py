"""Bad requests get OpenAI's error JSON with their status and a message naming the problem, and the server keeps
serving; clients that leave free their requests' slots and pages; a full server answers 503."""

import httpx
import openai
import pytest

from tests.serve.conftest import LIMITS, MAX_QUEUED, MODEL

TOO_LONG = list(range(5, 5 + LIMITS["max_seq_len"]))

# (endpoint, body, status, words the message must contain)
BAD_REQUESTS = {
    "not_json": ("completions", b'{"prompt": "hi",', 400, ["not valid JSON"]),
    "not_an_object": ("completions", b'["hi"]', 400, ["JSON object"]),
    "empty_prompt": ("completions", {"prompt": ""}, 400, ["empty"]),
    "empty_id_prompt": ("completions", {"prompt": []}, 400, ["empty"]),
    "too_long_prompt": ("completions", {"prompt": TOO_LONG}, 400, ["2048 tokens", "max_seq_len"]),
    "out_of_vocab_id": ("completions", {"prompt": [5, 100000]}, 400, ["100000", "vocabulary"]),
    "second_prompt_bad": ("completions", {"prompt": [[5, 6], [7, -3]]}, 400, ["prompt 1", "-3", "vocabulary"]),
    "bad_prompt_type": ("completions", {"prompt": [5, "six"]}, 400, ["prompt", "token ids"]),
    "negative_temperature": ("completions", {"prompt": "hi", "temperature": -1}, 400, ["temperature"]),
    "top_p_zero": ("completions", {"prompt": "hi", "top_p": 0}, 400, ["top_p"]),
    "top_k_below_minus_one": ("completions", {"prompt": "hi", "top_k": -5}, 400, ["top_k"]),
    "zero_max_tokens": ("completions", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    "zero_n": ("completions", {"prompt": "hi", "n": 0}, 400, ["n:"]),
    "n_beyond_capacity": ("completions", {"prompt": "hi", "n": 8 + MAX_QUEUED + 1}, 400, ["41 choices"]),
    "seed_out_of_range": ("completions", {"prompt": "hi", "seed": -1}, 400, ["seed"]),
    "string_for_bool": ("completions", {"prompt": "hi", "stream": "yes"}, 400, ["stream"]),
    "unknown_field": ("completions", {"prompt": "hi", "beam_width": 4}, 400, ["beam_width"]),
    "too_many_logprobs": ("completions", {"prompt": "hi", "logprobs": 21}, 400, ["logprobs"]),
    "unknown_model": ("completions", {"prompt": "hi", "model": "gpt-9"}, 404, ["gpt-9", MODEL]),
    "chat_no_messages": ("chat/completions", {"messages": []}, 400, ["messages"]),
    "chat_unknown_role": ("chat/completions", {"messages": [{"role": "robot", "content": "beep"}]}, 400,
                          ["unknown role: robot"]),
    "chat_unsupported_tools": ("chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [{"type": "function"}]}, 400, ["tools"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_a_message_then_the_server_serves(server, case):
    endpoint, body, status, words = BAD_REQUESTS[case]
    url = f"{server.url}/v1/{endpoint}"
    response = httpx.post(url, content=body, headers={"Content-Type": "application/json"}) \
        if isinstance(body, bytes) else httpx.post(url, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    good = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                            extra_body={"ignore_eos": True})
    assert good.choices[0].finish_reason == "length"


def test_the_openai_client_raises_the_servers_error(server):
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        server.client.completions.create(model="gpt-9", prompt="hi")


def test_unknown_path_is_a_404_error_json(server):
    response = httpx.get(f"{server.url}/v1/engines")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"


def long_request(**body) -> dict:
    """A request that runs to max_seq_len (about 2000 tokens, seconds on CPU) unless it is aborted."""
    return {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": None, "ignore_eos": True, **body}


ABORTED = 'jaxmodels_requests_finished_total{finish_reason="abort"}'
GENERATED = "jaxmodels_generation_tokens_total"
INTERNAL_ERRORS = 'jaxmodels_requests_rejected_total{status="500"}'
# Run to its end, a long request makes over 2000 tokens; aborted within a second of starting it makes far fewer.
FEW_TOKENS = LIMITS["max_seq_len"] // 2


def test_a_closed_stream_frees_its_slot_and_pages(server):
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(stream=True)) as response:
        lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
        assert next(lines).startswith("data: ")
        assert server.metrics()["jaxmodels_requests_running"] == 1
    after = server.wait_until_idle()
    assert after[GENERATED] - before[GENERATED] < FEW_TOKENS
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    assert after["jaxmodels_slots_used"] == 0
    assert after["jaxmodels_kv_pages_used"] == 0


def test_a_client_that_gives_up_on_a_whole_response_frees_its_request(server):
    before = server.metrics()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=long_request(), timeout=0.3)
    after = server.wait_until_idle()
    assert after[GENERATED] - before[GENERATED] < FEW_TOKENS
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    assert after["jaxmodels_slots_used"] == 0
    assert after.get(INTERNAL_ERRORS, 0) == before.get(INTERNAL_ERRORS, 0)  # the handler ended as planned


def test_a_full_server_answers_503_until_there_is_room(server):
    capacity = LIMITS["max_batch_size"] + MAX_QUEUED
    before = server.metrics()
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(stream=True, n=capacity)) as held:
        lines = held.iter_lines()
        assert next(lines).startswith("data: ")  # accepted: the server holds `capacity` requests now
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert "full" in response.json()["error"]["message"]
    assert server.wait_until_idle()[GENERATED] - before[GENERATED] < capacity * FEW_TOKENS
    good = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert good.usage.completion_tokens >= 1
