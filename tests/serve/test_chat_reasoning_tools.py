"""Chat completions with reasoning and tool calls, through the real server, engine and `openai` client.

The checkpoints are scripted (tests/serve/scripted.py): each family's tokenizer, with its tags as special tokens, a
template with the structure of the family's own, and weights that make greedy decoding write a chosen output, so
the real engine produces reasoning, content and tool calls in each family's format. Nemotron 3 Nano (model_type
nemotron_h) and GLM-5 (glm_moe_dsa) are served with the parsers the server picks itself; DeepSeek-V3.2, whose
checkpoint ships no chat template, is tested at the generation layer: its tokens fed to a choice's text pipeline.
"""

import json
import subprocess
import sys

import httpx
import pytest

import jaxmodels
from tests.serve.scripted import GLM5, NEMOTRON3, Family, build_tokenizer, write_scripted_checkpoint

LIMITS = dict(dtype="float32", max_batch_size=4, max_seq_len=1024, prefill_sizes=[128], decode_sizes=[4],
              progress=False)
MODEL = "scripted"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city, for some days.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# What the scripted models write (see scripted.py), and how the server reads it.
NEMOTRON3_REASONING = "The user wants the weather in Paris."
NEMOTRON3_CONTENT = "Let me look that up."
NEMOTRON3_CALL_TEXT = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                       "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
NEMOTRON3_CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}  # days: an integer, by schema
GLM5_REASONING = "The user asks about Paris."
GLM5_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


class Served:
    def __init__(self, url, path, llm):
        import openai

        self.url, self.path, self.tokenizer = url, path, llm.tokenizer
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    def chat(self, **body) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=120)

    def token_id(self, text: str) -> int:
        (token,) = self.tokenizer.encode(text, add_special_tokens=False).ids
        return token


def serve(tmp_path_factory, family: Family, **app_options):
    from jaxmodels.serve.app import build_app
    from jaxmodels.serve.chat_template import ChatTemplate
    from jaxmodels.serve.server import BackgroundServer

    path = write_scripted_checkpoint(tmp_path_factory.mktemp(family.model_type), family)
    llm = jaxmodels.LLM(path, **LIMITS)
    app = build_app(llm, model_name=MODEL, chat_template=ChatTemplate.from_directory(path), **app_options)
    with BackgroundServer(app) as background:
        served = Served(background.url, path, llm)
        yield served
        served.client.close()


@pytest.fixture(scope="module")
def nemotron3(tmp_path_factory):
    yield from serve(tmp_path_factory, NEMOTRON3)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    yield from serve(tmp_path_factory, GLM5)


def message_of(response: httpx.Response, index: int = 0) -> tuple[dict, str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][index]
    return choice["message"], choice["finish_reason"]


def call_of(tool_call: dict) -> dict:
    """A call as {"name", "arguments" (parsed)}, after checking its OpenAI shape."""
    assert set(tool_call) == {"id", "type", "function"} and tool_call["type"] == "function"
    assert tool_call["id"].startswith("call_")
    return {"name": tool_call["function"]["name"], "arguments": json.loads(tool_call["function"]["arguments"])}


# --- the checkpoints' own parsers, end to end ---------------------------------------------------------------------

def test_nemotron3_reasoning_content_and_tool_call(nemotron3):
    message, finish_reason = message_of(nemotron3.chat(messages=ASK, tools=TOOLS, temperature=0))
    assert set(message) == {"role", "content", "reasoning_content", "tool_calls"}
    assert message["role"] == "assistant"
    assert message["reasoning_content"] == NEMOTRON3_REASONING
    assert message["content"] == NEMOTRON3_CONTENT
    assert [call_of(c) for c in message["tool_calls"]] == [NEMOTRON3_CALL]
    assert finish_reason == "tool_calls"


def test_glm5_reasoning_and_a_call_without_content(glm5):
    response = glm5.chat(messages=ASK, tools=TOOLS, temperature=0, n=2)
    for index in range(2):
        message, finish_reason = message_of(response, index)
        assert message["reasoning_content"] == GLM5_REASONING
        assert message["content"] is None  # OpenAI's null content beside tool calls
        assert [call_of(c) for c in message["tool_calls"]] == [GLM5_CALL]
        assert finish_reason == "tool_calls"  # the model stopped with <|observation|>, an end-of-sequence token


def test_the_openai_client_reads_the_message(nemotron3):
    out = nemotron3.client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0)
    message = out.choices[0].message
    assert message.reasoning_content == NEMOTRON3_REASONING  # an extra field, kept by the client
    assert message.content == NEMOTRON3_CONTENT
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == NEMOTRON3_CALL["arguments"]
    assert out.choices[0].finish_reason == "tool_calls"


def fold_stream(chunks) -> dict[int, dict]:
    """Each choice's message and finish reason, put together from stream chunks (openai objects), checking that
    every delta carries one kind of part and that a call opens with its id and name before its arguments."""
    folded = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out = folded.setdefault(choice.index, {"reasoning_content": None, "content": None, "tool_calls": {},
                                                   "kinds": [], "finish_reason": None})
            delta = choice.delta
            reasoning = getattr(delta, "reasoning_content", None)
            kinds = [kind for kind, value in [("reasoning", reasoning), ("content", delta.content),
                                              ("tool_calls", delta.tool_calls)] if value]
            assert len(kinds) <= 1, f"a delta mixing {kinds}"
            out["kinds"] += kinds
            if reasoning:
                out["reasoning_content"] = (out["reasoning_content"] or "") + reasoning
            if delta.content:
                out["content"] = (out["content"] or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index not in out["tool_calls"]:
                    assert call.id.startswith("call_") and call.type == "function"
                    assert call.function.name and call.function.arguments == ""
                    out["tool_calls"][call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None
                    out["tool_calls"][call.index]["arguments"] += call.function.arguments
            if choice.finish_reason is not None:
                out["finish_reason"] = choice.finish_reason
    return folded


def whole_message(choice) -> dict:
    message = choice.message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    return {"reasoning_content": message.reasoning_content, "content": message.content, "tool_calls": calls,
            "finish_reason": choice.finish_reason}


@pytest.mark.parametrize("family", ["nemotron3", "glm5"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
def test_streamed_and_whole_responses_give_the_same_message(request, family, thinking):
    served = request.getfixturevalue(family)
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, n=2,
                extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    whole = served.client.chat.completions.create(**body)
    chunks = list(served.client.chat.completions.create(**body, stream=True,
                                                        stream_options={"include_usage": True}))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]  # each choice opens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    folded = fold_stream(chunks)
    for choice in whole.choices:
        streamed = folded[choice.index]
        expected = whole_message(choice)
        assert {**streamed, "tool_calls": list(streamed["tool_calls"].values()), "kinds": None} == {
            **expected, "kinds": None}
        assert expected["tool_calls"] and expected["finish_reason"] == "tool_calls"
        assert (expected["reasoning_content"] is not None) == thinking
        # Reasoning streams first, then content, then the call: its opening and then its arguments.
        kinds = [k for i, k in enumerate(streamed["kinds"]) if i == 0 or k != streamed["kinds"][i - 1]]
        assert kinds == (["reasoning"] if thinking else []) + (["content"] if expected["content"] else []) + [
            "tool_calls"]


def test_enable_thinking_reaches_the_template(nemotron3):
    """With enable_thinking false the prompt ends "<think></think>", and the scripted model starts from there."""
    def prompt_ids(**body):
        response = httpx.post(f"{nemotron3.url}/v1/tokenize", json={"messages": ASK, **body})
        return response.json()["tokens"]

    off = prompt_ids(chat_template_kwargs={"enable_thinking": False})
    assert off[-2:] == [nemotron3.token_id("<think>"), nemotron3.token_id("</think>")]
    assert prompt_ids()[-2:] == [nemotron3.token_id("<think>"), nemotron3.token_id("\n")]
    message, finish_reason = message_of(nemotron3.chat(messages=ASK, tools=TOOLS, temperature=0,
                                                       chat_template_kwargs={"enable_thinking": False},
                                                       return_token_ids=True))
    assert message["reasoning_content"] is None
    assert message["content"] == NEMOTRON3_CONTENT
    assert [call_of(c) for c in message["tool_calls"]] == [NEMOTRON3_CALL]


def test_without_tools_the_call_stays_content_with_its_special_tags(nemotron3):
    """No tools: nothing is read as a call. The tags are special tokens, written out because a parser (reasoning)
    reads the text; the end-of-sequence token that stopped the output is not text."""
    message, finish_reason = message_of(nemotron3.chat(messages=ASK, temperature=0))
    assert set(message) == {"role", "content", "reasoning_content"}
    assert message["reasoning_content"] == NEMOTRON3_REASONING
    assert message["content"] == NEMOTRON3_CONTENT + NEMOTRON3_CALL_TEXT
    assert finish_reason == "stop"


def test_tool_choice_none_renders_the_tools_but_reads_no_calls(nemotron3):
    plain = nemotron3.chat(messages=ASK, temperature=0).json()
    response = nemotron3.chat(messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, return_token_ids=True)
    message, finish_reason = message_of(response)
    assert "tool_calls" not in message
    assert message["content"] == NEMOTRON3_CONTENT + NEMOTRON3_CALL_TEXT
    assert finish_reason == "stop"
    prompt = nemotron3.tokenizer.decode(response.json()["prompt_token_ids"], skip_special_tokens=False)
    assert "<name>get_weather</name>" in prompt and "<type>integer</type>" in prompt
    assert response.json()["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("max_tokens, reasoning, content", [
    (1, NEMOTRON3_REASONING, None),  # cut inside the think block: reasoning only
    (3, NEMOTRON3_REASONING, NEMOTRON3_CONTENT),
    (6, NEMOTRON3_REASONING, NEMOTRON3_CONTENT + "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                                                 "</parameter>\n"),  # a call block cut short is content
])
def test_an_output_cut_by_max_tokens(nemotron3, max_tokens, reasoning, content):
    message, finish_reason = message_of(nemotron3.chat(messages=ASK, tools=TOOLS, temperature=0,
                                                       max_tokens=max_tokens))
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert "tool_calls" not in message
    assert finish_reason == "length"


# Earlier turns: the assistant's call (no content, arguments as OpenAI's JSON string) and the tool's answer.
ROUND_TRIP = ASK + [
    {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
     "tool_calls": [{"id": "call_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21 °C"},
]


@pytest.mark.parametrize("family", ["nemotron3", "glm5"])
def test_tool_calls_and_results_go_back_through_the_template(request, family):
    """The prompt of a conversation with a call and its result is the one transformers renders (which takes the
    arguments as a mapping, as its tool-use docs give them)."""
    from transformers import AutoTokenizer

    served = request.getfixturevalue(family)
    response = served.chat(messages=ROUND_TRIP, tools=TOOLS, temperature=0, return_token_ids=True)
    message, _ = message_of(response)
    assert message["tool_calls"]  # the scripted model calls again: its prompt ends as before
    as_transformers = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": {"city": "Paris",
                                                                                              "days": 3}}}
                                            for c in m["tool_calls"]]} if m.get("tool_calls") else m
                       for m in ROUND_TRIP]
    expected = AutoTokenizer.from_pretrained(served.path).apply_chat_template(
        as_transformers, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    prompt_ids = response.json()["prompt_token_ids"]
    assert prompt_ids == expected
    prompt = served.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert "Sunny, 21 °C</tool_response>" in prompt.replace("\n</tool_response>", "</tool_response>")
    assert "I should look it up." in prompt
    call = ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>"
            if family == "nemotron3" else
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
            "<arg_value>3</arg_value></tool_call>")
    assert call in prompt


def test_the_tags_are_special_tokens_that_decoding_would_skip(nemotron3):
    """The premise of keeping special tokens: decoded as usual, the tags vanish and no parser could find them."""
    tags = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    added = {t["content"]: t["special"] for t in json.loads((nemotron3.path / "tokenizer.json").read_text())[
        "added_tokens"]}
    assert all(added[tag] for tag in tags)
    ids = [nemotron3.token_id(tag) for tag in tags]
    assert nemotron3.tokenizer.decode(ids) == ""
    assert nemotron3.tokenizer.decode(ids, skip_special_tokens=False) == "".join(tags)


# --- parsers named at startup --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nemotron3_unparsed(tmp_path_factory):
    yield from serve(tmp_path_factory, NEMOTRON3, reasoning_parser="none", tool_call_parser="none")


def test_parsers_turned_off_serve_text_as_before(nemotron3_unparsed):
    """With --reasoning-parser none --tool-call-parser none, a chat answer is what it was before parsers: all
    content, special tokens (the tags) skipped."""
    message, finish_reason = message_of(nemotron3_unparsed.chat(messages=ASK, temperature=0))
    assert message == {"role": "assistant", "content": NEMOTRON3_REASONING + NEMOTRON3_CONTENT
                       + NEMOTRON3_CALL_TEXT.removeprefix("<tool_call>").removesuffix("</tool_call>")}
    assert finish_reason == "stop"
    refused = nemotron3_unparsed.chat(messages=ASK, tools=TOOLS)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in refused.json()["error"]["message"]
    shown = nemotron3_unparsed.chat(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert shown.status_code == 200


def test_an_unknown_parser_name_is_refused_before_loading():
    from jaxmodels.serve.app import build_app

    def never():
        raise AssertionError("loaded")

    with pytest.raises(ValueError) as error:
        build_app(load=never, model_name=MODEL, tool_call_parser="hermes")
    assert "'hermes'" in str(error.value)
    assert "auto, deepseek_v32, glm5, nemotron, nemotron3, none" in str(error.value)


def test_the_command_line_lists_the_parser_names():
    result = subprocess.run([sys.executable, "-m", "jaxmodels", "serve", "--model", "unused",
                             "--reasoning-parser", "qwen3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "--reasoning-parser: invalid choice: 'qwen3'" in result.stderr
    assert "'deepseek_v32', 'glm5', 'nemotron', 'nemotron3'" in result.stderr


# --- forced calls: the output is constrained to calls in the family's format ---------------------------------------

# Bounded values, so that any sampled call ends within max_tokens.
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}},
]


@pytest.mark.parametrize("family", ["nemotron3", "glm5"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_always_parse_and_validate(request, family, tool_choice, stream):
    """Sampled, without thinking (sampled free reasoning could run past max_tokens); the next test thinks."""
    import jsonschema

    served = request.getfixturevalue(family)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    for seed in range(3):
        create = dict(model=MODEL, messages=ASK, tools=FORCED_TOOLS, tool_choice=tool_choice, temperature=1.0,
                      seed=seed, max_tokens=300, stream=stream,
                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        if stream:
            (folded,) = fold_stream(served.client.chat.completions.create(**create)).values()
            calls, finish_reason = list(folded["tool_calls"].values()), folded["finish_reason"]
            calls = [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls]
        else:
            choice = served.client.chat.completions.create(**create).choices[0]
            calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                     for c in choice.message.tool_calls]
            finish_reason = choice.finish_reason
        assert calls and finish_reason == "tool_calls"
        for call in calls:
            assert tool_choice == "required" or call["name"] == "get_time"
            jsonschema.validate(call["arguments"], schemas[call["name"]])


@pytest.mark.parametrize("family, reasoning", [("nemotron3", NEMOTRON3_REASONING), ("glm5", GLM5_REASONING)])
def test_a_forced_call_follows_the_reasoning(request, family, reasoning):
    """With thinking on, the model reasons freely (the scripted reasoning, greedy) and the call comes after it."""
    served = request.getfixturevalue(family)
    message, finish_reason = message_of(served.chat(messages=ASK, tools=FORCED_TOOLS, temperature=0,
                                                    tool_choice={"type": "function",
                                                                 "function": {"name": "get_time"}}))
    assert message["reasoning_content"] == reasoning
    assert [call_of(c)["name"] for c in message["tool_calls"]] == ["get_time"]
    assert finish_reason == "tool_calls"


# --- bad requests --------------------------------------------------------------------------------------------------

ASSISTANT_CALL = {"role": "assistant", "content": None,
                  "tool_calls": [{"id": "call_0", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# (body beside messages=ASK, the param the 400 names, words its message holds)
BAD_REQUESTS = {
    "kwargs_not_an_object": ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", ["dictionary"]),
    "kwargs_set_messages": ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", ["messages"]),
    "tools_not_a_list": ({"tools": {"type": "function"}}, "tools", ["list"]),
    "tool_without_function": ({"tools": [{"type": "function"}]}, "tools", ["function", "required"]),
    "tool_of_another_type": ({"tools": [{**TOOLS[0], "type": "code_interpreter"}]}, "tools", ["type"]),
    "function_name_with_spaces": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools",
                                  ["'get weather'"]),
    "functions_named_alike": ({"tools": TOOLS * 2}, "tools", ["get_weather", "more than once"]),
    "properties_not_an_object": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": ["city"]}}}]}, "tools", ["properties"]),
    "tool_choice_with_response_format": ({"tools": TOOLS, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}}, None,
                                         ["forces a tool call", "response_format"]),
    "tool_choice_unknown_function": ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                                     "function": {"name": "get_time"}}},
                                     "tool_choice", ["get_time", "not among the tools"]),
    "tool_choice_misspelled": ({"tools": TOOLS, "tool_choice": "automatic"}, "tool_choice", ['"auto"']),
    "tool_choice_without_tools": ({"tool_choice": "auto"}, "tool_choice", ["needs tools"]),
    "tool_message_without_id": ({"messages": ASK + [ASSISTANT_CALL, {"role": "tool", "content": "Sunny"}]},
                                "messages", ["tool_call_id"]),
    "arguments_not_json": ({"messages": ASK + [{**ASSISTANT_CALL, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]},
        "messages", ["arguments", "JSON"]),
    "arguments_not_an_object": ({"messages": ASK + [{**ASSISTANT_CALL, "tool_calls": [{
        "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}]}]},
        "messages", ["JSON object"]),
    "user_message_with_calls": ({"messages": [{**ASK[0], "tool_calls": ASSISTANT_CALL["tool_calls"]}]}, "messages",
                                ["assistant"]),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_fields_get_a_400_naming_them(nemotron3, case):
    body, param, words = BAD_REQUESTS[case]
    response = nemotron3.chat(**{"messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def test_tokenize_takes_tools_too(nemotron3):
    with_tools = httpx.post(f"{nemotron3.url}/v1/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    chat = nemotron3.chat(messages=ASK, tools=TOOLS, max_tokens=1, return_token_ids=True).json()
    assert with_tools["tokens"] == chat["prompt_token_ids"]
    bad = httpx.post(f"{nemotron3.url}/v1/tokenize", json={"messages": ASK, "chat_template_kwargs": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


# --- the generation layer: DeepSeek-V3.2's DSML ------------------------------------------------------------------

DSML = "｜DSML｜"
DSV32 = Family(model_type="deepseek_v32", eos=["<｜end▁of▁sentence｜>"], template="", scripts={},
               special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                               "<think>", "</think>", DSML])


def dsml_invoke(city: str) -> str:
    return (f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">{city}</{DSML}parameter>'
            f'\n<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n')


DSV32_OUTPUT = (f"Two cities.</think>Checking both.\n\n<{DSML}function_calls>\n" + dsml_invoke("Paris")
                + dsml_invoke("Lyon") + f"</{DSML}function_calls>")


def run_choice(tokenizer, token_ids, chat_output, finish_reason="stop"):
    """A choice's deltas for `token_ids` arriving one at a time (the last with `finish_reason`), as Generation
    makes them from the engine's tokens."""
    from jaxmodels.serve.generation import _ChoiceText

    choice = _ChoiceText(0, tokenizer, [], chat_output)
    deltas = [choice.add([t], None) for t in token_ids[:-1]] + [choice.add(token_ids[-1:], finish_reason)]
    return [d for d in deltas if d is not None]


@pytest.mark.parametrize("parallel_tool_calls", [None, False], ids=["parallel", "first_call_only"])
def test_dsml_calls_at_the_generation_layer(parallel_tool_calls):
    from jaxmodels.serve.generation import Choice, OutputParsers
    from jaxmodels.serve.responses import ChatResponses

    tokenizer = build_tokenizer(DSV32)
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    token_ids = tokenizer.encode(DSV32_OUTPUT, add_special_tokens=False).ids + [eos]
    assert tokenizer.decode(token_ids).count("DSML") == 0  # DSML is a special token: plain decoding drops it
    parsers = OutputParsers.choose("deepseek_v32", None)
    assert (parsers.reasoning.name, parsers.tool_calls.name) == ("deepseek_v32", "deepseek_v32")
    prompt = "<｜begin▁of▁sentence｜><｜User｜>Weather in Paris and Lyon?<｜Assistant｜><think>"
    deltas = run_choice(tokenizer, token_ids, parsers.chat_output(
        prompt, tools=TOOLS, read_tool_calls=True, parallel_tool_calls=parallel_tool_calls))
    assert sum(len(d.token_ids) for d in deltas) == len(token_ids)
    assert deltas[-1].finish_reason == "tool_calls"
    responses = ChatResponses(MODEL, return_token_ids=False, parsed=True, reasoning=True)
    choice = Choice(0, parts=[part for d in deltas for part in d.parts])
    message = responses.message(choice.parts)
    cities = ["Paris"] if parallel_tool_calls is False else ["Paris", "Lyon"]
    assert message["reasoning_content"] == "Two cities."
    assert message["content"] == "Checking both."
    assert [call_of(c) for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": {"city": city, "days": 2}} for city in cities]
    assert len({c["id"] for c in message["tool_calls"]}) == len(cities)
    # The stream's chunks carry the same message.
    chunks = [chunk for d in deltas for chunk in responses.chunks(d)]
    streamed = {"reasoning_content": "", "content": "", "calls": {}}
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        streamed["reasoning_content"] += delta.get("reasoning_content", "")
        streamed["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = streamed["calls"].setdefault(call["index"], {"id": call.get("id"), "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    assert (streamed["reasoning_content"], streamed["content"]) == ("Two cities.", "Checking both.")
    assert [(c["id"], c["arguments"]) for c in streamed["calls"].values()] == [
        (c["id"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_parsers_the_generation_layer_skips_special_tokens_as_before():
    from jaxmodels.serve.generation import ChatOutput
    from jaxmodels.serve.tool_calls import ContentDelta

    tokenizer = build_tokenizer(DSV32)
    token_ids = tokenizer.encode(DSV32_OUTPUT, add_special_tokens=False).ids
    deltas = run_choice(tokenizer, token_ids, ChatOutput(), finish_reason="length")
    parts = [part for d in deltas for part in d.parts]
    assert all(isinstance(part, ContentDelta) for part in parts)
    assert "".join(part.text for part in parts) == "".join(d.text for d in deltas) == tokenizer.decode(token_ids)


def test_incremental_text_with_special_tokens_kept_is_the_full_decode():
    """Random ids, special tokens (DSML, the think tags) among them, streamed one at a time."""
    import numpy as np

    from jaxmodels.serve.detokenizer import IncrementalDetokenizer

    tokenizer = build_tokenizer(DSV32)
    rng = np.random.default_rng(0)
    for _ in range(10):
        ids = rng.integers(0, tokenizer.get_vocab_size(), size=40).tolist()
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        text = "".join(detokenizer.add([t]) for t in ids) + detokenizer.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=False)
