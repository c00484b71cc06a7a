"""Response bodies and stream chunks in OpenAI's format, for `/v1/completions` and `/v1/chat/completions`.

With `return_token_ids` (vLLM's extension) completion choices carry `prompt_token_ids` and `token_ids`, chat
responses `prompt_token_ids` and each chat choice `token_ids`; stream chunks carry the `token_ids` behind their text.
"""

import json
import time
import uuid

from jaxmodels.serve.generation import Choice, Delta


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

    def chunk(self, delta: Delta, usage_: dict | None = None) -> dict:
        choice = {"index": delta.index, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        return self._envelope(self.chunk_object_name, [self._with_ids(choice, delta.token_ids)], usage_)


class ChatResponses(_Responses):
    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def body(self, choices: list[Choice], prompt: list[int], usage_: dict) -> dict:
        out = [self._with_ids({"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                               "logprobs": None, "finish_reason": choice.finish_reason}, choice.token_ids)
               for choice in choices]
        body = self._envelope(self.object_name, out, usage_)
        if self.return_token_ids:
            body["prompt_token_ids"] = prompt
        return body

    def role_chunk(self, index: int) -> dict:
        """A chat stream opens each choice with the assistant's role and empty content."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope(self.chunk_object_name, [choice], None)

    def chunk(self, delta: Delta, usage_: dict | None = None) -> dict:
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        choice = {"index": delta.index, "delta": content, "logprobs": None, "finish_reason": delta.finish_reason}
        return self._envelope(self.chunk_object_name, [self._with_ids(choice, delta.token_ids)], usage_)
