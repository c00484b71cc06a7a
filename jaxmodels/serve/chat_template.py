"""The checkpoint's chat template, rendered through jinja2 the way transformers' `apply_chat_template` renders it.

Same sandboxed environment (trim_blocks, lstrip_blocks, loop controls), the same globals and filters
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), the tokenizer's named special tokens as
variables, the request's `tools` as the `tools` variable (OpenAI tool definitions, as transformers passes dict
tools), and messages with None values dropped, reasoning fields aliased and tool-call arguments as mappings. The
rendered text is encoded without adding special tokens: the template writes them.
"""

import datetime
import json
import os

# The special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning comes under; templates read the first (and gpt-oss ones `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables the renderer sets itself; extra template variables (chat_template_kwargs) may not replace them.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`, or a rendering error)."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        self.source = source  # read to tell which reasoning and tool-call formats the checkpoint uses
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def from_directory(cls, path) -> "ChatTemplate | None":
        """The template of a checkpoint directory, or None when it has none. As in transformers, a
        `chat_template.jinja` file wins over `chat_template` in tokenizer_config.json, and of several named
        templates the one called "default" is used."""
        path = os.fspath(path)
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        source = config.get("chat_template")
        template_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(template_file):
            with open(template_file, encoding="utf-8") as f:
                source = f.read()
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = {entry["name"]: entry["template"] for entry in source}.get("default")
        if not source:
            return None
        special = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
        return cls(source, special)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs) -> str:
        """The prompt text; `tools` are OpenAI tool definitions, `kwargs` extra template variables (e.g.
        enable_thinking). Raises ChatTemplateError when the template refuses the messages."""
        reserved = sorted(set(kwargs) & set(RESERVED_VARIABLES))
        if reserved:
            raise ValueError(f"template variables set by the server itself: {', '.join(reserved)}")
        messages = [_template_message(m) for m in messages]
        try:
            return self._template.render(messages=messages, tools=tools or None, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **kwargs})
        except Exception as e:  # the template is fixed, so whatever fails comes of the messages: the client's error
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its content."""
    return token["content"] if isinstance(token, dict) else str(token)


def _template_message(message: dict) -> dict:
    """A message as templates read it: None values dropped (transformers' templates test `is defined`), reasoning
    under each of its names, and tool-call arguments as mappings."""
    message = _alias_reasoning({k: v for k, v in message.items() if v is not None})
    if message.get("tool_calls"):
        message["tool_calls"] = [_call_with_mapping_arguments(call) for call in message["tool_calls"]]
    return message


def _call_with_mapping_arguments(call):
    """OpenAI sends a call's arguments as a JSON string; templates iterate them as a mapping (`arguments|items`,
    `arguments.items()`), the form transformers' tool-use examples give them in. A string that is not a JSON object
    is left as it is: the request's validation refuses those before they get here."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the
        body as it is (templates that use it would not even parse without the tag)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
