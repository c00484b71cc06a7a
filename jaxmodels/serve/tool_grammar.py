"""Grammars the server builds: a tool call in each family's format: what `tool_choice` "required" or a named function constrains
the output to, so that it always parses into calls whose arguments follow the tools' parameter schemas.

Each grammar is Lark for llguidance (engine.grammar), written from the formats jaxmodels.serve.tool_calls reads (see
its docstring for where each was taken from), in the layout the chat templates write past calls in:

- "nemotron": `<TOOLCALL>` JSON list of {"name", "arguments"} `</TOOLCALL>`; the list is one JSON schema.
- "nemotron3": `<tool_call>\\n<function=f>\\n` then `<parameter=k>\\nVALUE\\n</parameter>\\n` per argument, then
  `</function>\\n</tool_call>`; one block per call, blocks on lines of their own.
- "deepseek_v32": one `<｜DSML｜function_calls>` block holding an `<｜DSML｜invoke name="f">` per call, each argument
  a `<｜DSML｜parameter name="k" string="true|false">` element.
- "glm5": `<tool_call>f<arg_key>k</arg_key><arg_value>VALUE</arg_value>...</tool_call>`, one block per call.

Arguments come in the order of the schema's `properties`: the required ones always, the others optionally, no others.
A string-typed value is raw text (with a `maxLength` bound and an `enum` or `const` kept; `pattern` and `format`
are not enforced there), that cannot contain the element's end tag; any other value is JSON under its own schema
(llguidance's `%json`). A tag that is one special token of the tokenizer may be written as that token or as text.

Where the chat prompt leaves a think block open (reasoning on), the output starts with free reasoning up to the end
tag, and the constraint (a tool call, or a response_format) applies after it (`after_reasoning`).
"""

import json
import re

from jaxmodels.engine.grammar import GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, GrammarSpec
from jaxmodels.serve.tool_calls import DSML, declared_type

NEWLINE = "\n"
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without parameters
FORMATS = ("nemotron", "nemotron3", "deepseek_v32", "glm5")


def tool_call_grammar(format_name: str, tools: list[dict], *, parallel: bool = True, tokenizer=None,
                      json_options: dict | None = None, reasoning_end: str | None = None) -> GrammarSpec:
    """The grammar of one or more calls (exactly one if not `parallel`) to any of `tools` (OpenAI tool dicts, or
    bare function definitions) in `format_name`'s format. `tokenizer` (a `tokenizers.Tokenizer`): tags that are
    special tokens in it may be written as those tokens. `json_options`: llguidance's JSON options (whitespace).
    `reasoning_end`: the output starts inside a think block, free text up to this tag (then the calls)."""
    if format_name not in FORMATS:
        raise ValueError(f"no tool-call grammar for the format {format_name!r}: one of {', '.join(FORMATS)}")
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    functions = [tool.get("function", tool) for tool in tools]
    builder = _Builder(tokenizer, json_options or {}, reasoning_end)
    if format_name == "nemotron":
        return builder.nemotron(functions, parallel)
    return builder.blocks(format_name, functions, parallel)


def after_reasoning(spec: GrammarSpec, reasoning_end: str, *, tokenizer=None,
                    json_options: dict | None = None) -> GrammarSpec:
    """`spec` for an output that starts inside a think block: free reasoning up to `reasoning_end`, then text under
    `spec` (the reasoning parser puts the first part in reasoning_content, the rest in content). A client's own
    grammar (kind "grammar") is returned as it is: it constrains the output from its start."""
    builder = _Builder(tokenizer, json_options or {}, reasoning_end)
    if spec.kind == GRAMMAR:
        return spec
    if spec.kind == JSON_OBJECT:
        body = builder.json({"type": "object"})
    elif spec.kind == JSON_SCHEMA:
        body = builder.json(json.loads(spec.source))
    elif spec.kind == REGEX:
        body = "/" + re.sub(r"(?<!\\)/", r"\/", spec.source) + "/"
    else:
        body = " | ".join(_lark_string(option) for option in json.loads(spec.source))
    builder.rule("body", body)
    return builder.spec("body")


class _Builder:
    def __init__(self, tokenizer, json_options: dict, reasoning_end: str | None = None):
        self.tokenizer = tokenizer
        self.json_options = json_options
        self.reasoning_end = reasoning_end
        self.rules: list[str] = []
        self.lexemes: dict[tuple, tuple[str, str]] = {}  # (end tag, length bound) -> (name, pattern)

    def spec(self, start: str) -> GrammarSpec:
        if self.reasoning_end is not None:
            start = f"{self.reasoning()} {start}"
        lines = [f"start: {start}", *self.rules]
        lines += [f"{name}: {pattern}" for name, pattern in self.lexemes.values()]
        return GrammarSpec.grammar("\n".join(lines))

    def reasoning(self) -> str:
        """Free text up to the end of the think block, whose tag the model may write as text or as its special
        token."""
        raw = self.raw_text_then(self.reasoning_end)
        token = self.special_token(self.reasoning_end)
        if token is None:
            return raw
        self.lexemes["reasoning", None] = ("REASONING", "/(?s:.*)/")
        return f"(REASONING <[{token}]> | {raw})"

    def special_token(self, text: str) -> int | None:
        """The id of the special token that is `text`, if the tokenizer has one."""
        if self.tokenizer is None:
            return None
        token = self.tokenizer.token_to_id(text)
        special = token is not None and any(t.content == text and t.special
                                            for t in self.tokenizer.get_added_tokens_decoder().values())
        return token if special else None

    def tag(self, text: str) -> str:
        """A Lark expression for `text`: the literal, or that or its special token where it is one."""
        token = self.special_token(text)
        return _lark_string(text) if token is None else f"(<[{token}]> | {_lark_string(text)})"

    def json(self, schema) -> str:
        if not isinstance(schema, dict):
            schema = {}
        return "%json " + json.dumps({**schema, "x-guidance": self.json_options}, ensure_ascii=False)

    def raw_text_then(self, end: str, max_length: int | None = None) -> str:
        """A lexeme: text up to and including the first `end` (at most max_length characters before it)."""
        key = (end, max_length)
        if key not in self.lexemes:
            escaped = _regex_text(end)
            length = "*" if max_length is None else f"{{0,{int(max_length)}}}"
            name = f"TEXT_{len(self.lexemes)}"
            # Ends at the first `end`: nothing may follow an occurrence of it within the lexeme.
            self.lexemes[key] = (name, f"/(?s:.{length}){escaped}/ & ~/(?s:.*{escaped}.+)/")
        return self.lexemes[key][0]

    def string_value(self, schema: dict, end: str, before_end: str = "") -> str:
        """A string argument written as raw text, then `before_end` + `end`."""
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None and all(isinstance(c, str) for c in choices):
            return f"({' | '.join(_lark_string(c) for c in choices)}) {_lark_string(before_end + end)}"
        return self.raw_text_then(before_end + end, schema.get("maxLength"))

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def arguments(self, prefix: str, function: dict, write_argument) -> str:
        """The arguments of `function` in schema order (optional ones optional), each `write_argument(key,
        schema)`; a rule name, or '' when there are none."""
        parameters = function.get("parameters") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for i, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
            name = self.rule(f"{prefix}_{i}", write_argument(key, schema if isinstance(schema, dict) else {}))
            parts.append(name if key in required else f"{name}?")
        return " ".join(parts)

    def nemotron(self, functions: list[dict], parallel: bool) -> GrammarSpec:
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or NO_ARGUMENTS}} for f in functions]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        self.rule("calls", self.json(schema))
        return self.spec(f'{self.tag("<TOOLCALL>")} calls {self.tag("</TOOLCALL>")}')

    def blocks(self, format_name: str, functions: list[dict], parallel: bool) -> GrammarSpec:
        write = {"nemotron3": self.nemotron3_call, "deepseek_v32": self.dsml_invoke, "glm5": self.glm5_call}[
            format_name]
        calls = [self.rule(f"call_{i}", write(f"call_{i}", f)) for i, f in enumerate(functions)]
        self.rule("call", " | ".join(calls))
        if format_name == "deepseek_v32":  # one block of invokes
            invokes = 'call ("\\n" call)*' if parallel else "call"
            opening, closing = self.tag(f"<{DSML}function_calls>"), self.tag(f"</{DSML}function_calls>")
            return self.spec(f'{opening} "\\n" {invokes} {closing}')
        return self.spec('call ("\\n" call)*' if parallel else "call")

    def nemotron3_call(self, prefix: str, function: dict) -> str:
        def argument(key, schema):
            opening = _lark_string(f"<parameter={key}>\n")
            if _written_raw(schema):
                value = self.string_value(schema, "</parameter>", before_end="\n")
                return f"{opening} {value} {_lark_string(NEWLINE)}"
            return f"{opening} {self.json(schema)} {_lark_string(NEWLINE + '</parameter>' + NEWLINE)}"

        arguments = self.arguments(prefix, function, argument)
        header = _lark_string(NEWLINE + "<function=" + function["name"] + ">" + NEWLINE)
        footer = _lark_string("</function>" + NEWLINE)
        return f"{self.tag('<tool_call>')} {header} {arguments} {footer} {self.tag('</tool_call>')}"

    def dsml_invoke(self, prefix: str, function: dict) -> str:
        end = f"</{DSML}parameter>"

        def argument(key, schema):
            if _written_raw(schema):
                opening = _lark_string(f'<{DSML}parameter name="{key}" string="true">')
                return f"{opening} {self.string_value(schema, end)} {_lark_string(NEWLINE)}"
            opening = _lark_string(f'<{DSML}parameter name="{key}" string="false">')
            return f"{opening} {self.json(schema)} {_lark_string(end + NEWLINE)}"

        arguments = self.arguments(prefix, function, argument)
        header = _lark_string(f'<{DSML}invoke name="' + function["name"] + '">' + NEWLINE)
        return f"{header} {arguments} {_lark_string(f'</{DSML}invoke>' + NEWLINE)}"

    def glm5_call(self, prefix: str, function: dict) -> str:
        def argument(key, schema):
            opening = _lark_string(f"<arg_key>{key}</arg_key><arg_value>")
            if _written_raw(schema):
                return f"{opening} {self.string_value(schema, '</arg_value>')}"
            return f'{opening} {self.json(schema)} "</arg_value>"'

        arguments = self.arguments(prefix, function, argument)
        return f'{self.tag("<tool_call>")} {_lark_string(function["name"])} {arguments} {self.tag("</tool_call>")}'


def _written_raw(schema: dict) -> bool:
    """Whether an argument is written as raw text: where the parsers read it as a string (its type is string, or
    string or null)."""
    return declared_type(schema).kind == "string"


def _lark_string(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _regex_text(text: str) -> str:
    """`text` matched literally inside a Lark /regex/ (control characters as escapes: the regex is one line)."""
    escaped = []
    for char in text:
        if char in REGEX_SPECIAL:
            escaped.append("\\" + char)
        elif char.isascii() and not char.isprintable():
            escaped.append(f"\\x{{{ord(char):x}}}")
        else:  # (`\<` would be a word boundary in Rust's regex syntax)
            escaped.append(char)
    return "".join(escaped)


REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")
