"""Response bodies and stream chunks in OpenAI's format, for `/v1/completions` and `/v1/chat/completions`.

With `return_token_ids` (vLLM's extension) completion choices carry `prompt_token_ids` and `token_ids`, chat
responses `prompt_token_ids` and each chat choice `token_ids`; stream chunks carry the `token_ids` behind their text.

A chat message is built from its parts (generation.py): `reasoning_content` (where a reasoning parser reads the
output; null when the model did not reason), `content`, and `tool_calls` once the model made calls. A stream sends
each part as its own delta: `{"reasoning_content": ...}`, `{"content": ...}`, a call's opening
`{"tool_calls": [{index, id, type, function: {name, arguments: ""}}]}`, then its `{"tool_calls": [{index,
function: {arguments}}]}` deltas.

Logprobs cover every output token, the ones usage counts and `token_ids` lists: the end-of-sequence token that
stopped a choice and the tokens that completed a stop string included. A token's string is the token decoded alone,
special tokens kept (`TokenStrings`, which also gives its bytes). Completions answer OpenAI's legacy object:
`tokens`, `token_logprobs`, `top_logprobs` (per token a {token string: logprob} of the k most likely and the drawn
one, as OpenAI's "up to logprobs + 1"; two tokens of the same string keep the likelier; null with k = 0) and
`text_offset` (where each token's text starts in the choice's text, as generation.TokenLogprob says). Chat
completions answer `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`. A stream
chunk carries the logprobs of the tokens behind its text, so a stream's lists concatenate to the whole response's.
A logprob of -inf (a token that cannot be drawn, which JSON cannot carry) is sent as -9999.0, as OpenAI does.
"""

import json
import math
import re
import time
import uuid

from jaxmodels.serve.generation import Choice, Delta, Reasoning, TokenLogprob
from jaxmodels.serve.tool_calls import ArgumentsDelta, ContentDelta, ToolCallStart


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data) -> str:
    """One server-sent event; `data` is a JSON-able dict or the closing "[DONE]"."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


# GPT-2's byte-level alphabet, reversed: a byte-level BPE vocabulary writes each byte as one character, the
# printable ones as themselves and the others (controls, space, ...) as chr(256 + n), n counting them in byte order.
_PRINTABLE_BYTES = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
BYTE_LEVEL_BYTES = {chr(b): b for b in _PRINTABLE_BYTES} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE_BYTES)}
BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece vocabulary's tokens for single bytes
LOWEST_LOGPROB = -9999.0


class TokenStrings:
    """Each token's string (the token decoded alone, special tokens kept) and bytes, remembered: the same tokens
    come back again and again, twenty-one of them per output token with top_logprobs 20.

    The bytes are the token's raw bytes where the vocabulary says what they are: byte-level BPE (see
    BYTE_LEVEL_BYTES) and SentencePiece's byte-fallback tokens. There a lone token may be part of a character: its
    string is U+FFFD, its bytes are exact. Other tokens (added and special ones, other vocabularies) give the UTF-8
    of their string, which for a SentencePiece piece lacks the leading space that decoding it alone drops."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _decodes_byte_level(tokenizer)
        self.byte_fallback = bool(getattr(tokenizer.model, "byte_fallback", False))
        self.added = set(tokenizer.get_added_tokens_decoder())  # their vocabulary entry is their text
        self._strings: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def string(self, token: int) -> str:
        if token not in self._strings:
            self._strings[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self._strings[token]

    def bytes(self, token: int) -> list[int]:
        if token not in self._bytes:
            self._bytes[token] = list(self._raw_bytes(token))
        return self._bytes[token]

    def _raw_bytes(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token) if token not in self.added else None
        if piece and self.byte_level and all(char in BYTE_LEVEL_BYTES for char in piece):
            return bytes(BYTE_LEVEL_BYTES[char] for char in piece)
        if piece and self.byte_fallback and BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return self.string(token).encode()


def _decodes_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder (alone or in a sequence) maps byte-level characters back to bytes."""
    if tokenizer.decoder is None:
        return False
    config = json.loads(tokenizer.decoder.__getstate__())
    return "ByteLevel" in [config.get("type")] + [part.get("type") for part in config.get("decoders", [])]


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOWEST_LOGPROB


class _Responses:
    prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, model: str, *, return_token_ids: bool, token_strings: TokenStrings | None = None):
        """`token_strings`: how tokens are named in logprobs (needed when a choice has logprobs)."""
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.return_token_ids = return_token_ids
        self.token_strings = token_strings

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

    def __init__(self, model: str, *, return_token_ids: bool, token_strings: TokenStrings | None = None,
                 top_logprobs: int | None = None):
        """`top_logprobs`: the request's `logprobs` k (None: no logprobs)."""
        super().__init__(model, return_token_ids=return_token_ids, token_strings=token_strings)
        self.top_logprobs = top_logprobs

    def body(self, choices: list[Choice], prompts: list[list[int]], n: int, usage_: dict) -> dict:
        """`prompts[i // n]` is choice i's prompt."""
        out = []
        for choice in choices:
            item = self._with_ids({"index": choice.index, "text": choice.text,
                                   "logprobs": self.logprobs(choice.logprobs),
                                   "finish_reason": choice.finish_reason}, choice.token_ids)
            if self.return_token_ids:
                item["prompt_token_ids"] = prompts[choice.index // n]
            out.append(item)
        return self._envelope(self.object_name, out, usage_)

    def chunks(self, delta: Delta, usage_: dict | None = None) -> list[dict]:
        choice = {"index": delta.index, "text": delta.text, "logprobs": self.logprobs(delta.logprobs),
                  "finish_reason": delta.finish_reason}
        return [self._envelope(self.chunk_object_name, [self._with_ids(choice, delta.token_ids)], usage_)]

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's legacy logprobs object for these tokens (None: the request asked for none)."""
        if entries is None:
            return None
        string = self.token_strings.string
        return {"tokens": [string(e.token) for e in entries],
                "token_logprobs": [finite(e.logprob) for e in entries],
                "top_logprobs": [self._top(e) for e in entries] if self.top_logprobs else None,
                "text_offset": [e.text_offset for e in entries]}

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top = {}
        for token, logprob in entry.top + [(entry.token, entry.logprob)]:
            top.setdefault(self.token_strings.string(token), finite(logprob))  # the likelier of a string's tokens
        return top


class ChatResponses(_Responses):
    """`parsed`: parsers read the output, so empty content is null (as with OpenAI's tool-call messages);
    `reasoning`: a reasoning parser does, so messages carry `reasoning_content`.

    Logprobs go in `logprobs.content` for every output token, the reasoning's and the tool calls' included (OpenAI's
    object has no list for reasoning; vLLM too lists all tokens there): the parsers split text, not tokens, so a
    token cannot always be told to be reasoning or content (`</think>` in the middle of one, a tag held back). In a
    stream, a delta's logprobs ride on its last chunk, with its `token_ids`; its other chunks have null logprobs."""

    prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, *, return_token_ids: bool, parsed: bool = False, reasoning: bool = False,
                 token_strings: TokenStrings | None = None):
        super().__init__(model, return_token_ids=return_token_ids, token_strings=token_strings)
        self.parsed = parsed
        self.reasoning = reasoning

    def body(self, choices: list[Choice], prompt: list[int], usage_: dict) -> dict:
        out = [self._with_ids({"index": choice.index, "message": self.message(choice.parts),
                               "logprobs": self.logprobs(choice.logprobs), "finish_reason": choice.finish_reason},
                              choice.token_ids)
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
            choice = {"index": delta.index, "delta": body, "logprobs": self.logprobs(delta.logprobs) if last else None,
                      "finish_reason": delta.finish_reason if last else None}
            choice = self._with_ids(choice, delta.token_ids if last else [])
            out.append(self._envelope(self.chunk_object_name, [choice], usage_ if last else None))
        return out

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's chat logprobs object for these tokens (None: the request asked for none)."""
        if entries is None:
            return None
        return {"content": [{**self._token(e.token, e.logprob),
                             "top_logprobs": [self._token(token, logprob) for token, logprob in e.top]}
                            for e in entries]}

    def _token(self, token: int, logprob: float) -> dict:
        return {"token": self.token_strings.string(token), "logprob": finite(logprob),
                "bytes": self.token_strings.bytes(token)}


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
