"""Grammars the server builds. A tool call in each family's format is what `tool_choice` "required" or a named
function constrains the output to, so that it always parses into calls whose arguments follow the tools' schemas.

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
(llguidance's `%json`). A special token of the tokenizer inside the format's text (a tag, DSML's `｜DSML｜`) may be
written as that token or as text.

Where the chat prompt leaves a think block open (reasoning on), the output starts with free reasoning up to the end
tag, and the constraint (a tool call, or a response_format) applies after it (`after_reasoning`).
"""

import json
import re

from jaxmodels.engine.grammar import GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, GrammarSpec
from jaxmodels.serve.tool_calls import DSML, declared_type, json_or_text

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
        self.lexemes: dict[tuple, tuple[str, str]] = {}  # (what it ends with, length bound) -> (name, pattern)
        self._special = None

    def spec(self, start: str) -> GrammarSpec:
        if self.reasoning_end is not None:
            start = f"{self.reasoning()} {start}"
        lines = [f"start: {start}", *self.rules]
        lines += [f"{name}: {pattern}" for name, pattern in self.lexemes.values()]
        return GrammarSpec.grammar("\n".join(lines))

    def reasoning(self) -> str:
        """Free text up to the end of the think block."""
        return self.text_then(self.reasoning_end)

    def text_then(self, end: str, max_length: int | None = None) -> str:
        """Text (at most max_length characters) then `end`, whose special tokens (if any) may be written as those
        tokens or as text."""
        raw = self.raw_text_then(end, max_length)
        split = self.first_special(end)
        if split is None:
            return raw
        # Text cannot hold a special token: the text lexeme ends where it comes, ending with what precedes it.
        at, _ = split
        length = "*" if max_length is None else f"{{0,{int(max_length)}}}"
        key = ("before special", end[:at], max_length)
        if key not in self.lexemes:
            self.lexemes[key] = (f"TEXT_{len(self.lexemes)}", f"/(?s:.{length}){_regex_text(end[:at])}/")
        return f"({self.lexemes[key][0]} {self.literal(end[at:])} | {raw})"

    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the tokenizer's special tokens of more than one character."""
        if self._special is None:
            decoder = self.tokenizer.get_added_tokens_decoder() if self.tokenizer is not None else {}
            self._special = {t.content: i for i, t in decoder.items() if t.special and len(t.content) > 1}
        return self._special

    def first_special(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the first special token inside `text`, or None."""
        found = [(text.find(token), token) for token in self.special_tokens() if token in text]
        return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None

    def literal(self, text: str) -> str:
        """A Lark expression for `text`, each special token in it written as that token or as its text."""
        parts = []
        while text:
            split = self.first_special(text)
            if split is None:
                parts.append(_lark_string(text))
                break
            at, token = split
            if at:
                parts.append(_lark_string(text[:at]))
            parts.append(f"(<[{self.special_tokens()[token]}]> | {_lark_string(token)})")
            text = text[at + len(token):]
        return " ".join(parts)

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
            return f"({' | '.join(_lark_string(c) for c in choices)}) {self.literal(before_end + end)}"
        return self.text_then(before_end + end, schema.get("maxLength"))

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
        return self.spec(f'{self.literal("<TOOLCALL>")} calls {self.literal("</TOOLCALL>")}')

    def blocks(self, format_name: str, functions: list[dict], parallel: bool) -> GrammarSpec:
        write = {"nemotron3": self.nemotron3_call, "deepseek_v32": self.dsml_invoke, "glm5": self.glm5_call}[
            format_name]
        calls = [self.rule(f"call_{i}", write(f"call_{i}", f)) for i, f in enumerate(functions)]
        self.rule("call", " | ".join(calls))
        if format_name == "deepseek_v32":  # one block of invokes
            invokes = 'call ("\\n" call)*' if parallel else "call"
            opening, closing = self.literal(f"<{DSML}function_calls>"), self.literal(f"</{DSML}function_calls>")
            return self.spec(f'{opening} "\\n" {invokes} {closing}')
        return self.spec('call ("\\n" call)*' if parallel else "call")

    def nemotron3_call(self, prefix: str, function: dict) -> str:
        def argument(key, schema):
            opening = self.literal(f"<parameter={key}>\n")
            if _written_raw(schema):
                value = self.string_value(schema, "</parameter>", before_end="\n")
                return f"{opening} {value} {self.literal(NEWLINE)}"
            return f"{opening} {self.json(schema)} {self.literal(NEWLINE + '</parameter>' + NEWLINE)}"

        arguments = self.arguments(prefix, function, argument)
        header = self.literal(NEWLINE + "<function=" + function["name"] + ">" + NEWLINE)
        footer = self.literal("</function>" + NEWLINE)
        return f"{self.literal('<tool_call>')} {header} {arguments} {footer} {self.literal('</tool_call>')}"

    def dsml_invoke(self, prefix: str, function: dict) -> str:
        end = f"</{DSML}parameter>"

        def argument(key, schema):
            if _written_raw(schema):
                opening = self.literal(f'<{DSML}parameter name="{key}" string="true">')
                return f"{opening} {self.string_value(schema, end)} {self.literal(NEWLINE)}"
            opening = self.literal(f'<{DSML}parameter name="{key}" string="false">')
            return f"{opening} {self.json(schema)} {self.literal(end + NEWLINE)}"

        arguments = self.arguments(prefix, function, argument)
        header = self.literal(f'<{DSML}invoke name="' + function["name"] + '">' + NEWLINE)
        return f"{header} {arguments} {self.literal(f'</{DSML}invoke>' + NEWLINE)}"

    def glm5_call(self, prefix: str, function: dict) -> str:
        def argument(key, schema):
            opening = self.literal(f"<arg_key>{key}</arg_key><arg_value>")
            if _written_raw(schema):
                return f"{opening} {self.string_value(schema, '</arg_value>')}"
            return f"{opening} {self.json(schema)} {self.literal('</arg_value>')}"

        arguments = self.arguments(prefix, function, argument)
        return f"{self.literal('<tool_call>' + function['name'])} {arguments} {self.literal('</tool_call>')}"


def _written_raw(schema: dict) -> bool:
    """Whether an argument is written as raw text: where the parsers read it as a string (its type is string, or
    string or null)."""
    kind = declared_type(schema).kind
    if kind is not None or "type" in schema:
        return kind == "string"
    # No type: the parsers read JSON where the text is JSON, else the text; an enum of strings that do not read as
    # JSON is written raw (written as JSON strings they would keep their quotes).
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return bool(choices) and all(isinstance(c, str) and isinstance(json_or_text(c), str) for c in choices)


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
