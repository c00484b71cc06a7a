"""Structured output through the real server and the `openai` client: response_format's JSON schemas (and
structured_outputs' regex, choice and any-object) give outputs of a random-weight model that always parse and
validate, streamed or not, on chat and completions; bad values are 400s naming their field."""

import json
import re

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tests.engine.test_structured_output import SCHEMAS  # noqa: E402
from tests.serve.conftest import MODEL  # noqa: E402

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schemas_always_validate(server, stream):
    for i, schema in enumerate(SCHEMAS):
        for seed in range(2):
            create = dict(model=MODEL, messages=MESSAGES, temperature=1.0, seed=10 * i + seed, max_tokens=200,
                          response_format=response_format(schema), stream=stream)
            if stream:
                chunks = list(server.client.chat.completions.create(**create))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                choice = server.client.chat.completions.create(**create).choices[0]
                text, finish = choice.message.content, [choice.finish_reason]
            assert finish == ["stop"], text
            jsonschema.validate(json.loads(text), schema)


def test_completions_take_structured_outputs(server):
    cases = [({"regex": r"[a-c]{3}-[0-9]{2}"}, lambda text: re.fullmatch(r"[a-c]{3}-[0-9]{2}", text)),
             ({"choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
             ({"json": SCHEMAS[1]}, lambda text: jsonschema.validate(json.loads(text), SCHEMAS[1]) is None)]
    for constraint, check in cases:
        for stream in (False, True):
            out = server.client.completions.create(model=MODEL, prompt="Answer:", temperature=1.0, seed=3,
                                                   max_tokens=120, stream=stream,
                                                   extra_body={"structured_outputs": constraint})
            text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
            assert check(text), (constraint, text)


def test_json_object_on_completions(server):
    out = server.client.completions.create(model=MODEL, prompt="{", temperature=0.0, max_tokens=300,
                                           extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":  # an unbounded object may run out of tokens; a finished one parses
        assert isinstance(json.loads(out.choices[0].text), dict)


BAD = {
    "unknown_type": ({"response_format": {"type": "xml"}}, "response_format", ["json_schema"]),
    "schema_missing": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                       "response_format", ["schema"]),
    "schema_not_an_object": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": "[1"}}},
                             "response_format", ["schema"]),
    "unknown_schema_keyword": ({"response_format": response_format({"type": "object", "propertiesX": 3,
                                                                    "additionalProperties": "yes"})},
                               "response_format", ["response_format"]),
    "two_kinds": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", ["exactly one"]),
    "unknown_kind": ({"structured_outputs": {"xml": "a"}}, "structured_outputs", ["xml"]),
    "empty_choice": ({"structured_outputs": {"choice": []}}, "structured_outputs", ["choice"]),
    "bad_regex": ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", ["regex"]),
    "bad_grammar": ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", ["grammar"]),
    "both_fields": ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, None,
                    ["at most one"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_a_400_naming_the_field(server, case):
    body, param, words = BAD[case]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
