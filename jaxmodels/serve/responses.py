"""Response bodies and stream chunks in OpenAI's format, for `/v1/completions` and `/v1/chat/completions`.

With `return_token_ids` (vLLM's extension) completion choices carry `prompt_token_ids` and `token_ids`, chat
responses `prompt_token_ids` and each chat choice `token_ids`; stream chunks carry the `token_ids` behind their text.

A chat message is built from its parts (generation.py): `reasoning_content` (where a reasoning parser reads the
output; null when the model did not reason), `content`, and `tool_calls` once the model made calls. A stream sends
each part as its own delta: `{"reasoning_content": ...}`, `{"content": ...}`, a call's opening
`{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}`, then its `{"tool_calls": [{index,
function: {arguments}}]}` deltas.
"""

import json
import time
import uuid

from jaxmodels.serve.generation import Choice, Delta, Reasoning
from jaxmodels.serve.tool_calls import ArgumentsDelta, ContentDelta, ToolCallStart


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data) -> str:
    """One server-sent event; `data` is a JSON-able dict or the closing "[DONE]"."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class _Responses:
    prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, model: str, *, return_token_ids: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids

    def _envelope(self, object_name: str, choices: list[dict], usage_: dict | None) -> dict:
        body = {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def usage_chunk(self, usage_: dict) -> dict:
        """The closing chunk of a stream asked for with stream_options.include_usage."""
        return self._envelope(self.chunk_object_name, [], usage_)

    def _with_ids(self, choice: dict, token_ids: list[int]) -> dict:
        return {**choice, "token_ids": token_ids} if self.return_token_ids else choice


class CompletionResponses(_Responses):
    prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def body(self, choices: list[Choice], prompts: list[list[int]], n: int, usage_: dict) -> dict:
        """`prompts[i // n]` is choice i's prompt."""
        out = []
        for choice in choices:
            item = self._with_ids({"index": choice.index, "text": choice.text, "logprobs": None,
                                   "finish_reason": choice.finish_reason}, choice.token_ids)
            if self.return_token_ids:
                item["prompt_token_ids"] = prompts[choice.index // n]
            out.append(item)
        return self._envelope(self.object_name, out, usage_)

    def chunks(self, delta: Delta, usage_: dict | None = None) -> list[dict]:
        choice = {"index": delta.index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        return [self._envelope(self.chunk_object_name, [self._with_ids(choice, delta.token_ids)], usage_)]


class ChatResponses(_Responses):
    """`parsed`: parsers read the output, so empty content is null (as with OpenAI's tool-call messages);
    `reasoning`: a reasoning parser does, so messages carry `reasoning_content`."""

    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, *, return_token_ids: bool, parsed: bool = False, reasoning: bool = False):
        super().__init__(model, return_token_ids=return_token_ids)
        self.parsed = parsed
        self.reasoning = reasoning

    def body(self, choices: list[Choice], prompt: list[int], usage_: dict) -> dict:
        out = [self._with_ids({"index": choice.index, "message": self.message(choice.parts), "logprobs": None,
                               "finish_reason": choice.finish_reason}, choice.token_ids)
               for choice in choices]
        body = self._envelope(self.object_name, out, usage_)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt
        return body

    def message(self, parts: list) -> dict:
        """The assistant message that a choice's parts make up."""
        content = "".join(part.text for part in parts if isinstance(part, ContentDelta))
        message = {"role": "assistant", "content": content if content or not self.parsed else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(part.text for part in parts if isinstance(part, Reasoning)) or None
        calls = tool_calls_of(parts)
        if calls:
            message["tool_calls"] = calls
        return message

    def role_chunk(self, index: int) -> dict:
        """A chat stream opens each choice with the assistant's role and empty content."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice], None)

    def chunks(self, delta: Delta, usage_: dict | None = None) -> list[dict]:
        """One chunk per part of the delta (text of one kind joined); the last carries the finish reason, the usage
        and the delta's token ids. A delta without parts (the end of the output) is one chunk with an empty
        delta."""
        bodies = [delta_of(part) for part in joined(delta.parts)] or [{}]
        out = []
        for position, body in enumerate(bodies):
            last = position == len(bodies) - 1
            choice = {"index": delta.index, "delta": body, "logprobs": None,
                      "finish_reason": delta.finish_reason if last else None}
            choice = self._with_ids(choice, delta.token_ids if last else [])
            out.append(self._envelope(self.chunk_object_name, [choice], usage_ if last else None))
        return out


def joined(parts: list) -> list:
    """Neighbouring reasoning or content parts joined into one (tool-call events stay apart)."""
    out = []
    for part in parts:
        if out and type(part) is type(out[-1]) and isinstance(part, (Reasoning, ContentDelta)):
            out[-1] = type(part)(out[-1].text + part.text)
        else:
            out.append(part)
    return out


def delta_of(part) -> dict:
    """A part of a chat message as a stream chunk's `delta`."""
    if isinstance(part, Reasoning):
        return {"reasoning_content": part.text}
    if isinstance(part, ContentDelta):
        return {"content": part.text}
    if isinstance(part, ToolCallStart):
        return {"tool_calls": [{"index": part.index, "id": part.id, "type": "function",
                                "function": {"name": part.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}


def tool_calls_of(parts: list) -> list[dict]:
    """The calls that a choice's ToolCallStart and ArgumentsDelta parts make, in OpenAI's message format."""
    calls = {}
    for part in parts:
        if isinstance(part, ToolCallStart):
            calls[part.index] = {"id": part.id, "type": "function", "function": {"name": part.name, "arguments": ""}}
        elif isinstance(part, ArgumentsDelta):
            calls[part.index]["function"]["arguments"] += part.text
    return [calls[index] for index in sorted(calls)]
