"""The OpenAI request bodies we accept, and the error every failure is answered with.

Unknown fields are refused (a field we silently ignored would change what the client asked for without telling
it); OpenAI fields we do not implement are accepted only at their neutral value. `top_k`, `stop_token_ids`,
`ignore_eos`, `return_token_ids`, `chat_template_kwargs`, `repetition_penalty` and `min_tokens` are vLLM's
extensions, under vLLM's names.

Logprobs: completions take OpenAI's legacy `logprobs` k (an int; up to 20 here, as vLLM allows, where OpenAI stops at
5), chat completions `logprobs: true` and `top_logprobs` k. `top_logprobs` above 0 without `logprobs` is refused;
0 is taken as "not used", as it was before logprobs were served. `logit_bias` is OpenAI's object of token id strings
to numbers.

Tools are OpenAI function tools. `tool_choice` "auto" (the default with tools), "none", "required" and a named
function are served; the last two constrain the output to calls in the model's format (serve.tool_grammar), whose
arguments follow the tools' schemas. A function's `strict: true` is accepted: forced calls are constrained whatever
it says, and calls the model chooses to make under "auto" are parsed, not constrained (as vLLM does).

Structured output: `response_format` (OpenAI's `{"type": "json_object"}` and `{"type": "json_schema", "json_schema":
{"name", "schema", ...}}`, on both endpoints as vLLM takes it) or vLLM's `structured_outputs` object with one of
`json` (a schema), `json_object: true`, `regex`, `choice` (a list of strings) or `grammar` (Lark or GBNF); at most one
of the two, and not with a forced tool call.
"""

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxmodels.engine.grammar import GrammarSpec
from jaxmodels.engine.request import BIAS_ENTRIES, MAX_LOGPROBS, SamplingParams
from jaxmodels.serve.chat_template import RESERVED_VARIABLES


class APIError(Exception):
    """An error answered as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def validation_error(error: ValidationError | Any) -> APIError:
    """A 400 naming each bad field, from pydantic's (or FastAPI's) list of errors."""
    problems, params = [], []
    for item in error.errors():
        loc = [str(part) for part in item["loc"] if part != "body"]
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "json_invalid":  # its loc is the character position
            loc, message = [], f"the body is not valid JSON: {item.get('ctx', {}).get('error', message)}"
        elif item["type"] == "model_attributes_type" and not loc:
            message = "the body must be a JSON object (sent with Content-Type: application/json)"
        problems.append(f"{'.'.join(loc)}: {message}" if loc else message)
        params.append(loc[0] if loc else None)
    return APIError(400, "; ".join(problems), param=params[0] if params else None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


# OpenAI fields we do not implement, and the values that mean "not used".
NEUTRAL_VALUES = {
    "echo": (False, None), "best_of": (None, 1), "suffix": (None, ""),
}

# A logit_bias key: a token id written as a decimal string, as OpenAI's clients send them.
TOKEN_ID_STRING = re.compile(r"0|[1-9][0-9]*")
MAX_LOGIT_BIAS = 100
# The request fields the engine serves with its adjusting sampler, under SamplingParams' names (which are theirs).
ADJUSTMENT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                     "logprobs")


class _Sampled(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # answer with the prompt's and each choice's token ids (vLLM's name)
    user: str | None = None  # for the client's own tracking; ignored
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # None: 0
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)  # None: 1, off
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    response_format: Any = None
    structured_outputs: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias):
        if bias is None:
            return None
        keys = [key for key in bias if not TOKEN_ID_STRING.fullmatch(key)]
        if keys:
            raise ValueError(f"keys must be token ids as decimal strings, got {keys[0]!r}")
        values = [value for value in bias.values() if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS]
        if values:
            raise ValueError(f"values must be numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {values[0]!r}")
        if len(bias) > BIAS_ENTRIES:
            raise ValueError(f"has {len(bias)} entries; at most {BIAS_ENTRIES}")
        return bias

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        response_format_spec(value)  # ValueError: a 400 naming the field
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, value):
        structured_outputs_spec(value)
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        if response_format_spec(self.response_format) is not None and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs: send at most one of them")
        return self

    @property
    def structured_output(self) -> tuple[GrammarSpec, str] | None:
        """(what the output is constrained to, the field that asked for it), or None."""
        spec = response_format_spec(self.response_format)
        if spec is not None:
            return spec, "response_format"
        spec = structured_outputs_spec(self.structured_outputs)
        return (spec, "structured_outputs") if spec is not None else None

    @field_validator(*[name for name in NEUTRAL_VALUES], check_fields=False)
    @classmethod
    def _only_neutral(cls, value, info):
        if value not in NEUTRAL_VALUES[info.field_name]:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def top_logprobs_k(self) -> int | None:
        """How many of the most likely tokens come with each output token's logprob; None: no logprobs."""
        raise NotImplementedError

    @property
    def adjustments(self) -> list[str]:
        """The fields that adjust the logits or ask for logprobs set to more than their neutral values (a
        speculative engine serves none of them)."""
        params, neutral = self.sampling_params(max_new_tokens=1)[0], SamplingParams()
        return [name for name in ADJUSTMENT_FIELDS if getattr(params, name) != getattr(neutral, name)]

    def sampling_params(self, max_new_tokens: int, structured_output: GrammarSpec | None = None
                        ) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i draws with seed + i. `structured_output`: the
        grammar the server made of the request (see structured_output)."""
        bias = {int(token): value for token, value in self.logit_bias.items()} if self.logit_bias else None
        return [SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, stop_token_ids=tuple(self.stop_token_ids),
                               ignore_eos=self.ignore_eos, seed=None if self.seed is None else self.seed + i,
                               presence_penalty=self.presence_penalty or 0.0,
                               frequency_penalty=self.frequency_penalty or 0.0,
                               repetition_penalty=self.repetition_penalty or 1.0, min_tokens=self.min_tokens,
                               logit_bias=bias, logprobs=self.top_logprobs_k, structured_output=structured_output)
                for i in range(self.n)]

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # None: up to max_seq_len
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @property
    def top_logprobs_k(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompts(cls, value) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(_is_token_id(t) for t in value):
            return [value]  # also the empty list, which the engine rejects as an empty prompt
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            return value
        if isinstance(value, list) and all(isinstance(p, list) and all(map(_is_token_id, p)) for p in value):
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")


# OpenAI's rule for function names; it also keeps names readable back out of every tool-call format served here.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"function name {name!r} must be 1 to 64 letters, digits, underscores or dashes")
        return name

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, schema):
        # The tool-call parsers read each parameter's declared type from `properties`.
        if schema is not None and not isinstance(schema.get("properties", {}), dict):
            raise ValueError("parameters.properties must be an object mapping parameter names to schemas")
        return schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON object as a string; a mapping is taken too

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments):
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError as e:
                raise ValueError(f"arguments are not JSON: {e}") from e
            if not isinstance(parsed, dict):
                raise ValueError("arguments must be a JSON object")
        return arguments


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates read more than role and content (name, ...)
    role: str
    content: str | list[dict] | None = None  # None: an assistant message that only calls tools
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None  # a tool message answers the call with this id

    @model_validator(mode="after")
    def _tool_messages_name_their_call(self):
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message with role 'tool' needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        return self


def _check_template_kwargs(kwargs: dict | None) -> dict | None:
    reserved = sorted(set(kwargs or {}) & set(RESERVED_VARIABLES))
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here: the server sets them from the request")
    return kwargs


def _check_tool_names(tools: list[ToolDefinition] | None) -> list[ToolDefinition] | None:
    names = [tool.function.name for tool in tools or []]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"function names must differ: {', '.join(repeated)} given more than once")
    return tools


class ChatCompletionRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to max_seq_len
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # after logprobs: its validator reads it
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None  # after tools: its validator reads them
    response_format: Any = None
    parallel_tool_calls: bool | None = None  # False: only the first call of the output is returned

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)
    _tool_names = field_validator("tools")(_check_tool_names)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, k, info):
        if k and "logprobs" in info.data and not info.data["logprobs"]:
            raise ValueError("needs logprobs: true")
        return k

    @property
    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice, info):
        if "tools" not in info.data:
            return choice  # the tools are invalid, which their own error says
        if choice not in (None, "none", "auto", "required") and not _names_a_function(choice):
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
        if choice in (None, "none"):
            return choice
        names = [tool.function.name for tool in info.data["tools"] or []]
        if not names:
            raise ValueError(f"{json.dumps(choice)} needs tools: none were given")
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ValueError(f"names the function {choice['function']['name']!r}, which is not among the tools "
                             f"({', '.join(names)})")
        return choice

    @property
    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template and the tool-call parser read them (OpenAI's dicts), or None."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def forced_tools(self) -> list[dict] | None:
        """The tools a call must be made to (tool_choice "required": any of them; a named function: that one), as
        OpenAI dicts; None when the model may answer without a call."""
        if self.tool_choice == "required":
            return self.tool_definitions
        if _names_a_function(self.tool_choice):
            return [t for t in self.tool_definitions if t["function"]["name"] == self.tool_choice["function"]["name"]]
        return None

    @model_validator(mode="after")
    def _forced_call_alone(self):
        if self.forced_tools and self.structured_output is not None:
            raise ValueError(f"tool_choice {json.dumps(self.tool_choice)} forces a tool call: it cannot be "
                             f"combined with {self.structured_output[1]}")
        return self

    @property
    def reads_tool_calls(self) -> bool:
        """Whether the output is parsed into tool calls: with tools, unless tool_choice is "none"."""
        return bool(self.tools) and self.tool_choice != "none"


class TokenizeRequest(BaseModel):
    """/tokenize and /v1/tokenize (vLLM's): a `prompt` as completions encode it, or `messages` rendered through the
    chat template as chat completions do."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None  # rendered into the prompt, as chat completions render them
    return_token_strs: bool = False

    _template_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)
    _tool_names = field_validator("tools")(_check_tool_names)

    @property
    def tool_definitions(self) -> list[dict] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def response_format_spec(value) -> GrammarSpec | None:
    """OpenAI's response_format -> the grammar it asks for (None: text); ValueError saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ValueError('must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                         '"json_schema": {"name": ..., "schema": {...}}}')
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"}
    if extra:
        raise ValueError(f"unknown field(s) for type {kind!r}: {', '.join(sorted(extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}} with the schema as '
                         'a JSON object')
    unknown = set(inner) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"json_schema has unknown field(s): {', '.join(sorted(unknown))}")
    return GrammarSpec.json_schema(inner["schema"])


STRUCTURED_OUTPUT_KINDS = {"json": GrammarSpec.json_schema, "regex": GrammarSpec.regex, "choice": GrammarSpec.choice,
                           "grammar": GrammarSpec.grammar}


def structured_outputs_spec(value) -> GrammarSpec | None:
    """vLLM's structured_outputs object -> the grammar it asks for; ValueError saying what is wrong."""
    if value is None:
        return None
    kinds = [*STRUCTURED_OUTPUT_KINDS, "json_object"]
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with one of {', '.join(kinds)}")
    unknown = set(value) - set(kinds)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}: one of {', '.join(kinds)}")
    given = [kind for kind in kinds if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"needs exactly one of {', '.join(kinds)}, got {len(given)}")
    if given[0] == "json_object":
        if value["json_object"] is not True:
            raise ValueError("json_object must be true")
        return GrammarSpec.json_object()
    return STRUCTURED_OUTPUT_KINDS[given[0]](value[given[0]])


def _names_a_function(choice) -> bool:
    return (isinstance(choice, dict) and set(choice) == {"type", "function"} and choice["type"] == "function"
            and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"}
            and isinstance(choice["function"]["name"], str))


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
