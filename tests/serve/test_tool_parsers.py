"""Tool-call parsers: hand-written content of each family split into text and calls, at once and streamed cut at
every position, alone and behind the reasoning parser."""

import re

import pytest

from jaxmodels.serve.reasoning import DeepSeekV32ReasoningParser, Glm5ReasoningParser, Nemotron3ReasoningParser
from jaxmodels.serve.reasoning import NemotronReasoningParser
from tests.serve.test_reasoning_parsers import GLM5_TEMPLATE, NANO2_TEMPLATE, NEMOTRON3_TEMPLATE
from jaxmodels.serve.tool_calls import (ArgumentsDelta, ContentDelta, DeepSeekV32ToolCallParser, Glm5ToolCallParser,
                                        Nemotron3ToolCallParser, NemotronToolCallParser, ToolCallStart, collect,
                                        tool_call_parser_for)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
        "threshold": {"type": "number"}, "tags": {"type": "array"}, "filters": {"type": "object"},
        "cursor": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"name": "list_files", "parameters": {"type": "object", "properties": {}}},  # a bare function, no wrapper
]


def call(name, arguments):
    return {"name": name, "arguments": arguments}


NEMOTRON = [
    pytest.param("The weather is fine.", "The weather is fine.", [], id="no-calls"),
    pytest.param('Let me check.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
                 '</TOOLCALL>',
                 "Let me check.", [call("get_weather", '{"city": "Paris", "days": 3}')], id="content-then-call"),
    pytest.param('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_weather", "arguments": {"city": "Zürich"}}]</TOOLCALL>',
                 "", [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Zürich"}')],
                 id="two-calls"),
    pytest.param('<TOOLCALL>[\n  {"name": "write_file",\n   "arguments": {"path": "notes/日本.md", '
                 '"content": "# Title\\nline 2 \\u2014 ✓", "meta": {"tags": ["a", "b"], '
                 '"size": {"lines": 2, "ratio": 0.5}, "draft": false, "owner": null}}}\n]</TOOLCALL>',
                 "", [call("write_file", '{"path": "notes/日本.md", "content": "# Title\\nline 2 — ✓", '
                                         '"meta": {"tags": ["a", "b"], "size": {"lines": 2, "ratio": 0.5}, '
                                         '"draft": false, "owner": null}}')],
                 id="nested-multiline-unicode"),
    pytest.param('<TOOLCALL>[{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]</TOOLCALL>',
                 "", [call("get_weather", '{"city": "Oslo"}')], id="arguments-as-a-json-string"),
    pytest.param('<TOOLCALL>[{"name": "list_files", "arguments": {}}]</TOOLCALL>\n\nI called it.',
                 "I called it.", [call("list_files", "{}")], id="text-after-the-call"),
    pytest.param('Trying.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}]</TOOLCALL>',
                 'Trying.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}]</TOOLCALL>', [],
                 id="malformed-json"),
    pytest.param('Trying.\n\n<TOOLCALL>[{"name": "get_weather", "arg',
                 'Trying.\n\n<TOOLCALL>[{"name": "get_weather", "arg', [], id="unterminated"),
    pytest.param('A <TOOLCALL>oops</TOOLCALL> B\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
                 '</TOOLCALL>',
                 "A <TOOLCALL>oops</TOOLCALL> B", [call("get_weather", '{"city": "Rome"}')],
                 id="malformed-then-valid"),
    pytest.param("Tags look like <TOOLCAL or <TOOLCALLS>.", "Tags look like <TOOLCAL or <TOOLCALLS>.", [],
                 id="almost-tags"),
    pytest.param("Nothing to call.\n\n<TOOLCALL>[]</TOOLCALL>", "Nothing to call.", [], id="empty-call-list"),
]

NEMOTRON3 = [
    pytest.param("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", [], id="no-calls"),
    pytest.param("I'll check the weather.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                 "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n",
                 "I'll check the weather.", [call("get_weather", '{"city": "Paris", "days": 3}')],
                 id="content-then-call"),
    pytest.param("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                 "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                 "</function>\n</tool_call>",
                 "", [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Oslo"}')],
                 id="two-calls"),
    pytest.param("<tool_call>\n<function=search>\n<parameter=query>\n007\n</parameter>\n<parameter=limit>\n10\n"
                 "</parameter>\n<parameter=exact>\nTrue\n</parameter>\n<parameter=threshold>\n0.25\n</parameter>\n"
                 "<parameter=tags>\n[\"a\", \"ü\"]\n</parameter>\n<parameter=filters>\n"
                 "{\"year\": {\"min\": 2020}, \"lang\": null}\n</parameter>\n<parameter=cursor>\nNone\n</parameter>\n"
                 "</function>\n</tool_call>",
                 "", [call("search", '{"query": "007", "limit": 10, "exact": true, "threshold": 0.25, '
                                     '"tags": ["a", "ü"], "filters": {"year": {"min": 2020}, "lang": null}, '
                                     '"cursor": null}')],
                 id="values-typed-by-the-schema"),
    pytest.param("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/f.py\n</parameter>\n"
                 "<parameter=content>\ndef f():\n    return '→ ✓'\n\n</parameter>\n</function>\n</tool_call>",
                 "", [call("write_file", '{"path": "src/f.py", "content": "def f():\\n    return \'→ ✓\'\\n"}')],
                 id="multiline-unicode-string"),
    pytest.param("<tool_call>\n<function=lookup>\n<parameter=id>\n42\n</parameter>\n<parameter=verbose>\nFalse\n"
                 "</parameter>\n<parameter=name>\nAda Lovelace\n</parameter>\n<parameter=raw>\n\"quoted\"\n"
                 "</parameter>\n</function>\n</tool_call>",
                 "", [call("lookup", '{"id": 42, "verbose": false, "name": "Ada Lovelace", "raw": "\\"quoted\\""}')],
                 id="values-without-a-schema"),
    pytest.param("Calling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                 "Calling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
                 [], id="malformed-parameter"),
    pytest.param("Calling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                 "Calling.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [], id="unterminated"),
]

DSML_CALL = ("\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜function_calls>")

DEEPSEEK = [
    pytest.param("The answer is 4.", "The answer is 4.", [], id="no-calls"),
    pytest.param("Let me look." + DSML_CALL, "Let me look.", [call("get_weather", '{"city": "Paris", "days": 3}')],
                 id="content-then-call"),
    pytest.param("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                 "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                 "<｜DSML｜invoke name=\"list_files\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                 "", [call("get_weather", '{"city": "Paris"}'), call("list_files", "{}")], id="two-invokes"),
    pytest.param("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"search\">\n"
                 "<｜DSML｜parameter name=\"query\" string=\"true\">Zeile 1\nZeile 2 — 東京</｜DSML｜parameter>\n"
                 "<｜DSML｜parameter name=\"cursor\" string=\"true\">123</｜DSML｜parameter>\n"
                 "<｜DSML｜parameter name=\"filters\" string=\"false\">{\"tags\": [\"x\", \"y\"], "
                 "\"range\": [1, 2.5], \"deep\": {\"ok\": true}}</｜DSML｜parameter>\n"
                 "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                 "", [call("search", '{"query": "Zeile 1\\nZeile 2 — 東京", "cursor": "123", '
                                     '"filters": {"tags": ["x", "y"], "range": [1, 2.5], "deep": {"ok": true}}}')],
                 id="nested-multiline-unicode"),
    pytest.param("Hm.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                 "<｜DSML｜parameter name=\"city\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                 "Hm.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                 "<｜DSML｜parameter name=\"city\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
                 [], id="malformed-no-string-attribute"),
    pytest.param("Let me look." + DSML_CALL[:60], "Let me look." + DSML_CALL[:60], [], id="unterminated"),
    pytest.param("DSML has <｜DSML｜invoke> tags.", "DSML has <｜DSML｜invoke> tags.", [], id="tag-mentioned"),
]

GLM = [
    pytest.param("It is sunny.", "It is sunny.", [], id="no-calls"),
    pytest.param("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
                 "<arg_value>3</arg_value></tool_call>",
                 "", [call("get_weather", '{"city": "Paris", "days": 3}')], id="glm5-compact"),
    pytest.param("Checking both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                 "</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
                 "</tool_call>",
                 "Checking both.", [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Oslo"}')],
                 id="glm45-layout-two-calls"),
    pytest.param("<tool_call>search<arg_key>query</arg_key><arg_value>{\"looks\": \"like json\"}</arg_value>"
                 "<arg_key>limit</arg_key><arg_value>10</arg_value><arg_key>exact</arg_key><arg_value>true</arg_value>"
                 "<arg_key>tags</arg_key><arg_value>[\"a\", \"ü\"]</arg_value><arg_key>filters</arg_key>"
                 "<arg_value>{\"year\": {\"min\": 2020, \"max\": null}}</arg_value></tool_call>",
                 "", [call("search", '{"query": "{\\"looks\\": \\"like json\\"}", "limit": 10, "exact": true, '
                                     '"tags": ["a", "ü"], "filters": {"year": {"min": 2020, "max": null}}}')],
                 id="values-typed-by-the-schema"),
    pytest.param("<tool_call>write_file<arg_key>path</arg_key><arg_value>a.txt</arg_value><arg_key>content</arg_key>"
                 "<arg_value>line 1\nline 2 — ✓</arg_value></tool_call>",
                 "", [call("write_file", '{"path": "a.txt", "content": "line 1\\nline 2 — ✓"}')],
                 id="multiline-unicode-string"),
    pytest.param("<tool_call>list_files</tool_call>", "", [call("list_files", "{}")], id="no-arguments"),
    pytest.param("<tool_call>I will call the weather tool</tool_call>",
                 "<tool_call>I will call the weather tool</tool_call>", [], id="malformed-name"),
    pytest.param("So:\n<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>",
                 "So:\n<tool_call>get_weather<arg_key>city</arg_key>Paris</tool_call>", [], id="malformed-value"),
    pytest.param("It ends in <tool_ca", "It ends in <tool_ca", [], id="cut-start-tag-at-the-end"),
    pytest.param("So:\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",
                 "So:\n<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par", [], id="unterminated"),
]

CASES = ([pytest.param(NemotronToolCallParser, *p.values, id="nemotron-" + p.id) for p in NEMOTRON]
         + [pytest.param(Nemotron3ToolCallParser, *p.values, id="nemotron3-" + p.id) for p in NEMOTRON3]
         + [pytest.param(DeepSeekV32ToolCallParser, *p.values, id="dsv32-" + p.id) for p in DEEPSEEK]
         + [pytest.param(Glm5ToolCallParser, *p.values, id="glm-" + p.id) for p in GLM])


def stream(parser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def outcome(events) -> tuple:
    """What a client sees: the content, the calls, and each call's index, id and name in order."""
    content, calls = collect(events)
    starts = [(e.index, e.id, e.name) for e in events if isinstance(e, ToolCallStart)]
    return content, calls, starts


@pytest.mark.parametrize("parser_class, text, content, calls", CASES)
def test_parse_at_once(parser_class, text, content, calls):
    assert parser_class(tools=TOOLS).parse(text) == (content, calls)


@pytest.mark.parametrize("parser_class, text, content, calls", CASES)
def test_streamed_in_two_pieces_cut_anywhere_and_char_by_char(parser_class, text, content, calls):
    expected = outcome(stream(parser_class(tools=TOOLS, seed=7), [text]))
    assert expected[:2] == (content, calls)
    for cut in range(len(text) + 1):
        events = stream(parser_class(tools=TOOLS, seed=7), [text[:cut], text[cut:]])
        assert outcome(events) == expected, f"cut: {text[:cut]!r} | {text[cut:]!r}"
        # Deltas are only appended, so equal totals mean no piece of a tag went out as text; where the content
        # has no "<", no content delta may have one.
        assert "<" in content or not any("<" in e.text for e in events if isinstance(e, ContentDelta))
    events = stream(parser_class(tools=TOOLS, seed=7), list(text))
    assert outcome(events) == expected
    assert "<" in content or not any("<" in e.text for e in events if isinstance(e, ContentDelta))


def test_events_of_a_call():
    parser = NemotronToolCallParser(seed=1)
    assert parser.feed("Let me check.\n\n<TOOL") == [ContentDelta("Let me check.")]
    assert parser.feed('CALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ') == []
    events = parser.feed('{"name": "list_files", "arguments": {}}]</TOOLCALL>')
    assert [type(e) for e in events] == [ToolCallStart, ArgumentsDelta, ToolCallStart, ArgumentsDelta]
    assert [(e.index, e.name) for e in events[0::2]] == [(0, "get_weather"), (1, "list_files")]
    assert [(e.index, e.text) for e in events[1::2]] == [(0, '{"city": "Paris"}'), (1, "{}")]
    assert parser.finish() == []


def test_only_what_could_become_a_call_is_held_back():
    parser = Glm5ToolCallParser()
    assert parser.feed("Plain text") == [ContentDelta("Plain text")]
    assert parser.feed(" and <") == [ContentDelta(" and")]  # " <" could begin "<tool_call>"
    assert parser.feed("b>bold</b>\n") == [ContentDelta(" <b>bold</b>")]  # the newline could precede a call
    assert parser.feed("more") == [ContentDelta("\nmore")]
    assert parser.finish() == []


def test_call_ids():
    first = DeepSeekV32ToolCallParser(seed=3).parse("Let me look." + DSML_CALL)[1]
    events = stream(DeepSeekV32ToolCallParser(seed=3), ["Let me look." + DSML_CALL] * 2)
    ids = [e.id for e in events if isinstance(e, ToolCallStart)]
    assert len(ids) == 2 and len(set(ids)) == 2
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert ids == [e.id for e in stream(DeepSeekV32ToolCallParser(seed=3), ["Let me look." + DSML_CALL] * 2)
                   if isinstance(e, ToolCallStart)]  # a seed repeats them
    assert first == [call("get_weather", '{"city": "Paris", "days": 3}')]
    unseeded = [e.id for parser in (DeepSeekV32ToolCallParser(), DeepSeekV32ToolCallParser())
                for e in parser.feed("Let me look." + DSML_CALL) if isinstance(e, ToolCallStart)]
    assert unseeded[0] != unseeded[1]


# The reasoning parser's content fed on into the tool-call parser, as a server streams a response.
CHAINED = [
    pytest.param(NemotronReasoningParser, NemotronToolCallParser, "<SPECIAL_11>Assistant\n<think>\n\n",
                 'Need the weather.\n</think>\n\nChecking.\n\n<TOOLCALL>[{"name": "get_weather", '
                 '"arguments": {"city": "Paris"}}]</TOOLCALL>',
                 "Need the weather.\n", "Checking.", [call("get_weather", '{"city": "Paris"}')], id="nemotron"),
    pytest.param(Nemotron3ReasoningParser, Nemotron3ToolCallParser, "<|im_start|>assistant\n<think>\n",
                 "Need the weather.\n</think>\nA </think> in content.\n<tool_call>\n<function=get_weather>\n"
                 "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n",
                 "Need the weather.\n", "A </think> in content.", [call("get_weather", '{"days": 2}')],
                 id="nemotron3"),
    pytest.param(DeepSeekV32ReasoningParser, DeepSeekV32ToolCallParser, "<｜Assistant｜><think>",
                 "Need the weather.</think>Let me look." + DSML_CALL,
                 "Need the weather.", "Let me look.", [call("get_weather", '{"city": "Paris", "days": 3}')],
                 id="dsv32"),
    pytest.param(Glm5ReasoningParser, Glm5ToolCallParser, "<|assistant|><think>",
                 "Need the weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
                 "</tool_call>",
                 "Need the weather.", "", [call("get_weather", '{"city": "Paris"}')], id="glm5"),
]


def stream_chained(reasoning_parser, tool_parser, pieces) -> tuple[str, str, list]:
    reasoning, events = [], []
    for piece in pieces:
        r, c = reasoning_parser.feed(piece)
        reasoning.append(r)
        events += tool_parser.feed(c)
    r, c = reasoning_parser.finish()
    reasoning.append(r)
    events += tool_parser.feed(c) + tool_parser.finish()
    content, calls = collect(events)
    return "".join(reasoning), content, calls


@pytest.mark.parametrize("reasoning_class, tool_class, prompt, text, reasoning, content, calls", CHAINED)
def test_reasoning_then_tool_calls_streamed(reasoning_class, tool_class, prompt, text, reasoning, content, calls):
    for cut in range(len(text) + 1):
        got = stream_chained(reasoning_class(prompt), tool_class(tools=TOOLS), [text[:cut], text[cut:]])
        assert got == (reasoning, content, calls), f"cut: {text[:cut]!r} | {text[cut:]!r}"
    assert stream_chained(reasoning_class(prompt), tool_class(tools=TOOLS), list(text)) == (reasoning, content, calls)


DSV32_TEMPLATE = '{%- set dsml_token = "｜DSML｜" -%}<{{ dsml_token }}function_calls>'


def test_parser_chosen_from_model_type_and_template():
    assert tool_call_parser_for("nemotron_h", NANO2_TEMPLATE) is NemotronToolCallParser
    assert tool_call_parser_for("nemotron_h", NEMOTRON3_TEMPLATE) is Nemotron3ToolCallParser
    assert tool_call_parser_for("nemotron_h", "{{ messages }}") is None
    assert tool_call_parser_for("deepseek_v32", None) is DeepSeekV32ToolCallParser
    assert tool_call_parser_for("deepseek_v32", DSV32_TEMPLATE) is DeepSeekV32ToolCallParser
    assert tool_call_parser_for("glm_moe_dsa", GLM5_TEMPLATE) is Glm5ToolCallParser
    assert tool_call_parser_for("glm_moe_dsa", "[gMASK]<sop>{{ messages }}") is None  # a template without tools
    assert tool_call_parser_for("llama", "{{ messages }}") is None


def test_parser_named_outright():
    assert tool_call_parser_for("llama", None, override="nemotron3") is Nemotron3ToolCallParser
    with pytest.raises(ValueError) as error:
        tool_call_parser_for("glm_moe_dsa", GLM5_TEMPLATE, override="hermes")
    assert "'hermes'" in str(error.value)
    assert "deepseek_v32, glm5, nemotron, nemotron3" in str(error.value)
