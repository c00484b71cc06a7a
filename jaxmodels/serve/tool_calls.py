"""Finding tool calls in a chat model's content, streamed or at once, in the formats of the families served here.

A parser reads the content stream (what the reasoning parser leaves after the reasoning) and turns each tool-call
block into a call with a name and its arguments as a JSON object string, whatever the model wrote them as. Where
each format was read (the checkpoints' own templates and encoding code; the template writes past calls exactly the
way the model is taught to write new ones):

- Nemotron Nano 2 ("nemotron"): nvidia/NVIDIA-Nemotron-Nano-9B-v2, `chat_template` in tokenizer_config.json (as in
  llama.cpp's models/templates/NVIDIA-Nemotron-Nano-v2.jinja). Calls are one JSON list after the content and a blank
  line: `<TOOLCALL>[{"name": "f", "arguments": {...}}, ...]</TOOLCALL>`.
- Nemotron 3 Nano ("nemotron3"): nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16, chat_template.jinja (as in llama.cpp's
  models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja). Qwen3-Coder-style XML, one block per call:
  `<tool_call>\\n<function=f>\\n<parameter=k>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`. Objects and arrays
  are written as JSON, other values through jinja's `string` filter (Python's str: `True`, `None`, `3`), strings
  as they are.
- DeepSeek-V3.2 ("deepseek_v32"): deepseek-ai/DeepSeek-V3.2, encoding/encoding_dsv32.py (no jinja template). One
  block after the content and a blank line, with fullwidth bars (U+FF5C) around DSML:
  `<｜DSML｜function_calls>\\n<｜DSML｜invoke name="f">\\n<｜DSML｜parameter name="k" string="true">VALUE` +
  `</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>`; `string="true"` marks a string written as
  it is, `string="false"` a value written as JSON.
- GLM-5 ("glm5"): zai-org/GLM-5, chat_template.jinja, the same call format as zai-org/GLM-4.7's:
  `<tool_call>f<arg_key>k</arg_key><arg_value>VALUE</arg_value>...</tool_call>`, strings as they are and
  everything else as JSON. GLM-4.5/4.6 (their chat_template.jinja) put newlines between the parts.

Where a format leaves a value's type to the reader (Nemotron 3, GLM), the request's tool schemas decide: pass
`tools` (OpenAI tool definitions). A parameter the schemas do not type is read as a JSON number, boolean, null,
object or array where its text is one (for Nemotron 3 also Python's `True`, `False`, `None`), else as a string.
DSML says `string="false"` for JSON values; text there that is not JSON stays a string rather than the call lost.

A call is announced only once its block has closed and parsed: an event, once streamed, cannot be taken back, and
a malformed or unterminated block must stay content. Whitespace between content and a call block is the template's
layout and is dropped; all other text that is not a well-formed call is content.
"""

import dataclasses
import json
import random
import re
import secrets

from jaxmodels.serve.reasoning import format_name_for, named_parser, partial_tag_length

WHITESPACE = " \t\r\n"


@dataclasses.dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallStart:
    index: int  # counts calls over the whole output, from 0
    id: str
    name: str


@dataclasses.dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str  # the call's deltas, concatenated, are its arguments as a JSON object string


class MalformedCall(ValueError):
    """A tool-call block that does not follow its format; its text is content."""


class ToolCallParser:
    """Splits content into text and tool calls, one delta at a time.

    `feed(delta)` returns the events it can release now, `finish()` those held back once the output has ended. Text
    is held back only while it could still become a call: a start tag cut at the end of a delta, the whitespace
    before it, and an open block until its end tag. Subclasses name the block's tags and read its inside.
    """

    name = ""
    START_TAG = ""
    END_TAG = ""
    TEMPLATE_MARKER = ""  # text that a chat template writing this format's calls contains

    def __init__(self, tools: list[dict] | None = None, seed: int | None = None):
        self.tools = tools
        self.seed = seed
        self.parameter_types = parameter_types(tools)
        # Ids are random; a seed makes them repeatable (tests, and `parse` matching a stream).
        self._random = random.Random(seed) if seed is not None else None
        self._pending = ""  # text not yet released
        self._in_block = False  # whether _pending is the inside of an open block
        self._layout = ""  # the whitespace between the content and the open block
        self._after_call = False  # drop the whitespace that follows a call (the template's layout)
        self._calls = 0

    def feed(self, delta: str) -> list:
        """Take the next piece of content; returns ContentDelta, ToolCallStart and ArgumentsDelta events."""
        events = []
        searched = len(self._pending)  # an end tag found now must end inside the new text
        self._pending += delta
        while self._pending:
            if self._in_block:
                end = self._pending.find(self.END_TAG, max(0, searched - len(self.END_TAG) + 1))
                if end < 0:
                    break
                block, self._pending = self._pending[:end], self._pending[end + len(self.END_TAG):]
                self._in_block = False
                self._close_block(block, events)
            else:
                if self._after_call:
                    self._pending = self._pending.lstrip(WHITESPACE)
                    if not self._pending:
                        break
                    self._after_call = False
                start = self._pending.find(self.START_TAG)
                if start < 0:
                    keep = self._held_back()
                    self._content(self._pending[:len(self._pending) - keep], events)
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                before = self._pending[:start]
                text = before.rstrip(WHITESPACE)
                self._content(text, events)
                self._layout = before[len(text):]
                self._pending = self._pending[start + len(self.START_TAG):]
                self._in_block = True
            searched = 0
        return events

    def finish(self) -> list:
        """The output has ended: what was held back is content, an unterminated block included."""
        events = []
        if self._in_block:
            self._content(self._layout + self.START_TAG + self._pending, events)
        else:
            self._content(self._pending, events)  # a cut start tag, or whitespace that no call followed
        self._pending, self._in_block = "", False
        return events

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The whole content at once: (text, [{"name": ..., "arguments": JSON string}, ...]). Leaves this parser
        untouched (a fresh one with the same tools and seed reads the text)."""
        parser = type(self)(tools=self.tools, seed=self.seed)
        return collect(parser.feed(text) + parser.finish())

    def read_block(self, block: str) -> list[tuple[str, dict]]:
        """The calls in one block's inside, as (name, arguments); raises MalformedCall."""
        raise NotImplementedError

    def _close_block(self, block: str, events: list):
        try:
            calls = self.read_block(block)
        except MalformedCall:
            self._content(self._layout + self.START_TAG + block + self.END_TAG, events)
            return
        for name, arguments in calls:
            index, self._calls = self._calls, self._calls + 1
            events.append(ToolCallStart(index, self._new_id(), name))
            events.append(ArgumentsDelta(index, json.dumps(arguments, ensure_ascii=False)))
        self._after_call = True

    def _held_back(self) -> int:
        """How much of the end of _pending could still begin a call block: a cut start tag and the whitespace
        before it."""
        keep = partial_tag_length(self._pending, self.START_TAG)
        rest = self._pending[:len(self._pending) - keep]
        return keep + len(rest) - len(rest.rstrip(WHITESPACE))

    @staticmethod
    def _content(text: str, events: list):
        if not text:
            return
        if events and isinstance(events[-1], ContentDelta):
            events[-1] = ContentDelta(events[-1].text + text)
        else:
            events.append(ContentDelta(text))

    def _new_id(self) -> str:
        bits = self._random.getrandbits(96) if self._random is not None else secrets.randbits(96)
        return f"call_{bits:024x}"


def collect(events: list) -> tuple[str, list[dict]]:
    """Events folded into (content, [{"name": ..., "arguments": ...}, ...])."""
    content, calls = [], {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"name": event.name, "arguments": ""}
        else:
            calls[event.index]["arguments"] += event.text
    return "".join(content), list(calls.values())


# --- values ------------------------------------------------------------------------------------------------------

PYTHON_LITERALS = {"True": True, "False": False, "None": None}


@dataclasses.dataclass(frozen=True)
class ParameterType:
    kind: str | None  # the JSON schema type, or None where the schema gives no single one
    nullable: bool = False  # "type": [kind, "null"]


UNTYPED = ParameterType(None)


def parameter_types(tools: list[dict] | None) -> dict[str, dict[str, ParameterType]]:
    """{function name: {parameter: its type}} from OpenAI tool definitions (or bare function definitions)."""
    types = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name")] = {name: declared_type(schema) for name, schema in properties.items()}
    return types


def declared_type(schema) -> ParameterType:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the one type that is not null
        kinds = [k for k in kind if k != "null"]
        return ParameterType(kinds[0] if len(kinds) == 1 else None, nullable="null" in kind)
    return ParameterType(kind if isinstance(kind, str) else None)


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would make the arguments string invalid JSON


def loads_json(text: str):
    return json.loads(text, parse_constant=_reject_constant)


def json_or_text(text: str):
    """A value written as JSON; text that is not JSON is kept as a string rather than the call lost."""
    try:
        return loads_json(text.strip(WHITESPACE))
    except ValueError:
        return text


def typed_value(text: str, declared: ParameterType, python_literals: bool = False):
    """A value written as text, read as its declared type: strings stay as they are, other types are read as JSON
    (and as Python literals where the template wrote them with str()); text that does not read stays a string."""
    literal = text.strip(WHITESPACE)
    if python_literals and literal in PYTHON_LITERALS and declared.kind != "string":
        return PYTHON_LITERALS[literal]
    if declared.kind == "string":
        null = declared.nullable and literal in (("null", "None") if python_literals else ("null",))
        return None if null else text
    value = json_or_text(text)
    if declared.kind is None and isinstance(value, str):
        return text  # `"x"`, quotes and all, for a parameter of unknown type is more likely a string
    return value


# --- formats -----------------------------------------------------------------------------------------------------

class NemotronToolCallParser(ToolCallParser):
    """Nemotron Nano 2: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`."""

    name = "nemotron"
    START_TAG = "<TOOLCALL>"
    END_TAG = "</TOOLCALL>"
    TEMPLATE_MARKER = "<TOOLCALL>"

    def read_block(self, block):
        try:
            entries = loads_json(block)
        except ValueError as e:
            raise MalformedCall(f"not JSON: {e}") from e
        if not isinstance(entries, list):
            raise MalformedCall("not a list of calls")
        return [self._read_entry(entry) for entry in entries]

    @staticmethod
    def _read_entry(entry) -> tuple[str, dict]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise MalformedCall("a call without a name")
        arguments = entry.get("arguments", {})
        if isinstance(arguments, str):  # the template copies string arguments in as they are: JSON text
            try:
                arguments = loads_json(arguments)
            except ValueError as e:
                raise MalformedCall("arguments are not a JSON object") from e
        if not isinstance(arguments, dict):
            raise MalformedCall("arguments are not a JSON object")
        return function_name(entry["name"]), arguments


class Scanner:
    """Reads a block's inside left to right; every mismatch is a MalformedCall."""

    def __init__(self, text: str, at: int = 0):
        self.text = text
        self.at = at

    def skip_whitespace(self):
        while self.at < len(self.text) and self.text[self.at] in WHITESPACE:
            self.at += 1

    def done(self) -> bool:
        return self.at == len(self.text)

    def accept(self, literal: str) -> bool:
        if self.text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return False

    def until(self, literal: str) -> str:
        """The text up to `literal`, which is consumed too."""
        end = self.text.find(literal, self.at)
        if end < 0:
            raise MalformedCall(f"missing {literal!r}")
        text, self.at = self.text[self.at:end], end + len(literal)
        return text

    def match(self, pattern: re.Pattern) -> re.Match:
        found = pattern.match(self.text, self.at)
        if found is None:
            raise MalformedCall(f"expected {pattern.pattern!r}")
        self.at = found.end()
        return found


def tag_name(text: str) -> str:
    """A parameter name from inside a tag: one line, no markup."""
    if not text or any(c in text for c in "<>\n"):
        raise MalformedCall(f"bad parameter name {text!r}")
    return text


def function_name(text: str) -> str:
    """A function name: no markup and no whitespace (a sentence where a name should be is not a call)."""
    if not text or any(c in text for c in "<>" + WHITESPACE):
        raise MalformedCall(f"bad function name {text!r}")
    return text


class Nemotron3ToolCallParser(ToolCallParser):
    """Nemotron 3 Nano: `<tool_call><function=f><parameter=k>\\nVALUE\\n</parameter></function></tool_call>`."""

    name = "nemotron3"
    START_TAG = "<tool_call>"
    END_TAG = "</tool_call>"
    TEMPLATE_MARKER = "<function="

    def read_block(self, block):
        scan = Scanner(block)
        scan.skip_whitespace()
        if not scan.accept("<function="):
            raise MalformedCall("expected <function=")
        name = function_name(scan.until(">"))
        types = self.parameter_types.get(name, {})
        arguments = {}
        while True:
            scan.skip_whitespace()
            if scan.accept("</function>"):
                break
            if not scan.accept("<parameter="):
                raise MalformedCall("expected <parameter= or </function>")
            key = tag_name(scan.until(">"))
            value = scan.until("</parameter>")
            # The template writes "<parameter=k>\n" + value + "\n</parameter>": one newline each side is layout.
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, types.get(key, UNTYPED), python_literals=True)
        scan.skip_whitespace()
        if not scan.done():
            raise MalformedCall("text after </function>")
        return [(name, arguments)]


DSML = "｜DSML｜"  # fullwidth vertical bars, U+FF5C
DSML_INVOKE = re.compile(f'<{DSML}invoke name="([^"<>\\s]+)">')
DSML_PARAMETER = re.compile(f'<{DSML}parameter name="([^"<>\\n]+)" string="(true|false)">')


class DeepSeekV32ToolCallParser(ToolCallParser):
    """DeepSeek-V3.2 DSML: `<｜DSML｜function_calls>` holding `<｜DSML｜invoke name=...>` elements."""

    name = "deepseek_v32"
    START_TAG = f"<{DSML}function_calls>"
    END_TAG = f"</{DSML}function_calls>"
    TEMPLATE_MARKER = "function_calls"  # templates write the DSML token through a variable

    def read_block(self, block):
        scan = Scanner(block)
        calls = []
        while True:
            scan.skip_whitespace()
            if scan.done():
                break
            name = scan.match(DSML_INVOKE).group(1)
            arguments = {}
            while True:
                scan.skip_whitespace()
                if scan.accept(f"</{DSML}invoke>"):
                    break
                key, is_string = scan.match(DSML_PARAMETER).groups()
                value = scan.until(f"</{DSML}parameter>")
                arguments[key] = value if is_string == "true" else json_or_text(value)
            calls.append((name, arguments))
        return calls


class Glm5ToolCallParser(ToolCallParser):
    """GLM-5 (and GLM-4.5/4.6/4.7): `<tool_call>f<arg_key>k</arg_key><arg_value>VALUE</arg_value></tool_call>`."""

    name = "glm5"
    START_TAG = "<tool_call>"
    END_TAG = "</tool_call>"
    TEMPLATE_MARKER = "<arg_key>"

    def read_block(self, block):
        # The name runs up to the first argument (GLM-4.5/4.6 put a newline after it, GLM-4.7/5 nothing).
        name_end = block.find("<arg_key>")
        name_end = name_end if name_end >= 0 else len(block)
        name = function_name(block[:name_end].strip(WHITESPACE))
        types = self.parameter_types.get(name, {})
        scan = Scanner(block, at=name_end)
        arguments = {}
        while True:
            scan.skip_whitespace()
            if scan.done():
                break
            if not scan.accept("<arg_key>"):
                raise MalformedCall("expected <arg_key>")
            key = tag_name(scan.until("</arg_key>").strip(WHITESPACE))
            scan.skip_whitespace()
            if not scan.accept("<arg_value>"):
                raise MalformedCall("expected <arg_value>")
            arguments[key] = typed_value(scan.until("</arg_value>"), types.get(key, UNTYPED))
        return [(name, arguments)]


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    cls.name: cls for cls in (NemotronToolCallParser, Nemotron3ToolCallParser, DeepSeekV32ToolCallParser,
                              Glm5ToolCallParser)
}


def tool_call_parser_for(model_type: str | None, chat_template: str | None = None,
                         override: str | None = None) -> type[ToolCallParser] | None:
    """The tool-call parser class for a checkpoint (call it with the request's tools), or None where the model has
    no known tool-call format. `override` names one outright (a `--tool-call-parser` flag)."""
    if override is not None:
        return named_parser("tool-call", TOOL_CALL_PARSERS, override)
    name = format_name_for(model_type, chat_template)
    if name is None:
        return None
    parser = TOOL_CALL_PARSERS[name]
    if chat_template is not None and parser.TEMPLATE_MARKER not in chat_template:
        return None  # the template never writes a call: a checkpoint without tool calling
    return parser
