"""The OpenAI request bodies we accept, and the error every failure is answered with.

Unknown fields are refused (a field we silently ignored would change what the client asked for without telling
it); OpenAI fields we do not implement are accepted only at their neutral value. `top_k`, `stop_token_ids`,
`ignore_eos` and `return_token_ids` are vLLM's extensions, under vLLM's names.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxmodels.engine.request import SamplingParams


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
    "echo": (False, None), "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}


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
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None

    @field_validator(*[name for name in NEUTRAL_VALUES], check_fields=False)
    @classmethod
    def _only_neutral(cls, value, info):
        if value not in NEUTRAL_VALUES[info.field_name]:
            raise ValueError(f"{info.field_name}={value!r} is not supported by this server")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_new_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i draws with seed + i."""
        return [SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, stop_token_ids=tuple(self.stop_token_ids),
                               ignore_eos=self.ignore_eos, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampled):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)  # None: up to max_seq_len
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # templates read more than role and content (name, tool_calls, ...)
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: up to max_seq_len
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None  # meaningless without tools; accepted because clients send it


class TokenizeRequest(BaseModel):
    """/tokenize and /v1/tokenize (vLLM's): a `prompt` as completions encode it, or `messages` rendered through the
    chat template as chat completions do."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
