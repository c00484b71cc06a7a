"""One HTTP request's generation as the event loop sees it: engine requests in (one per choice), text out.

Each choice's tokens go through an incremental detokenizer and then the stop strings; a stop string ends the choice
here and aborts its engine request. A generation that ends early (client gone, error) aborts whatever is unfinished,
so the engine frees those slots and pages at its next step.

A chat choice's text goes on through its `ChatOutput`: the reasoning parser splits off the reasoning, the tool-call
parser finds calls in the content. Both stream, so a delta carries the parts of the message that its text completes
(`parts`): `Reasoning`, `ContentDelta`, `ToolCallStart` and `ArgumentsDelta`, in the order the model wrote them. A
streamed response sends them as they come and a whole one folds them, so both end with the same message.

With logprobs, each token's (`TokenLogprob`) travels with the token: a delta carries the logprobs of exactly its
`token_ids`, the tokens behind its text. A token whose text is held back (half a character, a possible stop string,
a possible tag) waits with its logprobs, so over a choice's deltas every token's logprobs arrive once, in order,
whatever batches the engine's tokens came in.
"""

import dataclasses
import re

from jaxmodels.engine.request import SamplingParams
from jaxmodels.serve.detokenizer import IncrementalDetokenizer
from jaxmodels.serve.metrics import ServerStats
from jaxmodels.serve.protocol import APIError
from jaxmodels.serve.reasoning import REASONING_PARSERS, ReasoningParser, named_parser, reasoning_parser_for
from jaxmodels.serve.stop_strings import StopStrings
from jaxmodels.serve.tool_calls import (TOOL_CALL_PARSERS, ContentDelta, ToolCallParser, ToolCallStart,
                                        tool_call_parser_for)
from jaxmodels.serve.worker import EngineStopped, EngineWorker, Rejected, Ticket, Tokens


# Parser names that are not formats: "auto" picks the checkpoint's own, "none" turns parsing off.
AUTO, NO_PARSER = "auto", "none"


# The request fields that the engine's refusals name by SamplingParams' names (a message starts with one).
ENGINE_FIELDS = {**{field.name: field.name for field in dataclasses.fields(SamplingParams)},
                 "max_new_tokens": "max_tokens"}


class Rejection(APIError):
    """The engine refused one of the requests (`choice`; None when the engine has stopped). `param` is the field its
    message starts with, if any."""

    def __init__(self, status: int, message: str, choice: int | None):
        super().__init__(status, message, param=field_named(message))
        self.choice = choice


def field_named(message: str) -> str | None:
    """The request field that an engine refusal is about, when its message starts with the field's name."""
    first = re.match(r"\w+", message)
    return ENGINE_FIELDS.get(first.group()) if first else None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """An output token's log probability and those of the most likely tokens at its position, and where its text
    starts in the choice's output as decoded (in characters, before a stop string cuts it: the tokens that complete
    a stop string point at or past the end of the text returned)."""

    token: int
    logprob: float
    top: list  # [(token id, logprob)], the most likely first
    text_offset: int


@dataclasses.dataclass
class Delta:
    """What one choice gained: text to send, the tokens behind it, and the finish reason once it is done. A chat
    choice's delta also carries its text as parts of the message (see ChatOutput); with logprobs, a delta carries
    its tokens' (one TokenLogprob per token id; None without logprobs)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    parts: list = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    parts: list = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """Reasoning text (the model's thinking), apart from the content."""

    text: str


class ChatOutput:
    """One chat choice's text -> parts of its message: Reasoning, then the content as ContentDelta, ToolCallStart and
    ArgumentsDelta events (tool_calls.py's). Without parsers all text is content, as it was before parsers existed.

    The tool-call parser reads only what the reasoning parser calls content: a call written while thinking is
    thought, not made. `max_calls` (1 with parallel_tool_calls false) drops the calls past it.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tool_calls: ToolCallParser | None = None, *,
                 max_calls: int | None = None):
        self.reasoning = reasoning
        self.tool_calls = tool_calls
        self.max_calls = max_calls
        self.made_calls = False

    @property
    def parses(self) -> bool:
        """Whether a parser reads the text (which must then keep its special tokens: the tags often are ones)."""
        return self.reasoning is not None or self.tool_calls is not None

    def feed(self, text: str) -> list:
        if self.reasoning is None:
            return self._content(text)
        reasoning, content = self.reasoning.feed(text)
        return self._reasoning(reasoning) + self._content(content)

    def finish(self) -> list:
        """The text has ended: what the parsers held back (a cut tag, an unterminated call block: plain text)."""
        parts = []
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            parts = self._reasoning(reasoning) + self._content(content)
        if self.tool_calls is not None:
            parts += self._kept(self.tool_calls.finish())
        return parts

    @staticmethod
    def _reasoning(text: str) -> list:
        return [Reasoning(text)] if text else []

    def _content(self, text: str) -> list:
        if self.tool_calls is None:
            return [ContentDelta(text)] if text else []
        return self._kept(self.tool_calls.feed(text))

    def _kept(self, events: list) -> list:
        kept = [e for e in events if isinstance(e, ContentDelta) or self.max_calls is None or e.index < self.max_calls]
        self.made_calls = self.made_calls or any(isinstance(e, ToolCallStart) for e in kept)
        return kept


@dataclasses.dataclass(frozen=True)
class OutputParsers:
    """The reasoning and tool-call parser classes a server reads chat output with (None: that parser is off),
    chosen once: the checkpoint's own formats, or the ones named on the command line."""

    reasoning: type[ReasoningParser] | None = None
    tool_calls: type[ToolCallParser] | None = None

    @staticmethod
    def check_names(reasoning: str = AUTO, tool_calls: str = AUTO) -> None:
        """ValueError naming the valid choices for an unknown parser name (before loading anything)."""
        for kind, registry, name in (("reasoning", REASONING_PARSERS, reasoning),
                                     ("tool-call", TOOL_CALL_PARSERS, tool_calls)):
            if name not in (AUTO, NO_PARSER):
                named_parser(kind, {**registry, AUTO: None, NO_PARSER: None}, name)  # the error lists all names

    @classmethod
    def choose(cls, model_type: str | None, chat_template: str | None, *, reasoning: str = AUTO,
               tool_calls: str = AUTO) -> "OutputParsers":
        """`reasoning` and `tool_calls`: "auto" (from model_type and the template's text), "none", or a name."""
        cls.check_names(reasoning, tool_calls)

        def pick(name, parser_for):
            if name == NO_PARSER:
                return None
            return parser_for(model_type, chat_template, override=None if name == AUTO else name)

        return cls(pick(reasoning, reasoning_parser_for), pick(tool_calls, tool_call_parser_for))

    def describe(self) -> str:
        names = [parser.name if parser else "none" for parser in (self.reasoning, self.tool_calls)]
        return f"reasoning parser: {names[0]}, tool-call parser: {names[1]}"

    def chat_output(self, prompt: str, *, tools: list[dict] | None, read_tool_calls: bool,
                    parallel_tool_calls: bool | None = None) -> ChatOutput:
        """A fresh ChatOutput for one choice of a chat request whose rendered prompt is `prompt` (its end says
        whether the output starts inside a think block)."""
        reasoning = self.reasoning(prompt) if self.reasoning is not None else None
        tool_calls = self.tool_calls(tools=tools) if read_tool_calls and self.tool_calls is not None else None
        return ChatOutput(reasoning, tool_calls, max_calls=1 if parallel_tool_calls is False else None)


class _ChoiceText:
    """Tokens -> text for one choice: detokenized incrementally, then cut at the first stop string, then (chat)
    parsed into parts. Tokens whose text is held back (an unfinished character, a possible stop string, a possible
    tag) wait to go out with it."""

    def __init__(self, index: int, tokenizer, stops: list[str], chat_output: ChatOutput | None = None, *,
                 logprobs: bool = False):
        self.index = index
        self.logprobs = logprobs  # whether its tokens come with logprobs, to be sent with them
        self.chat_output = chat_output
        # Parsed text keeps special tokens; the token that stopped the output is not text then (see `_text`).
        self.keeps_special_tokens = chat_output is not None and chat_output.parses
        self.detokenizer = (IncrementalDetokenizer(tokenizer, skip_special_tokens=not self.keeps_special_tokens)
                            if tokenizer is not None else None)
        self.stops = StopStrings(stops)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._decoded_chars = 0  # characters the detokenizer has given out (before stop strings)
        self._unsent: list[int] = []
        self._unsent_logprobs: list[TokenLogprob] = []

    def add(self, token_ids: list[int], finish_reason: str | None, logprobs: list | None = None) -> Delta | None:
        """The delta to send now, or None while everything new is held back. `logprobs`: one (logprob, top) per
        token, with logprobs."""
        text, starts, kept = self._text(token_ids, finish_reason)
        # The tokens after the one that completed a stop string are not part of the choice, however many of them
        # the engine's step (or the event loop's lag) delivered in this batch.
        token_ids = token_ids[:kept]
        self.num_tokens += len(token_ids)
        self._unsent += token_ids
        if self.logprobs:
            self._unsent_logprobs += [TokenLogprob(token, logprob, top, start) for token, (logprob, top), start
                                      in zip(token_ids, logprobs[:kept], starts, strict=True)]
        if self.stops.matched:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.stops.flush()
        parts = self._parts(text, finish_reason)
        if self.chat_output is not None and self.chat_output.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"  # the model stopped after calling: the client runs the calls next
        self.finish_reason = finish_reason
        held_back = not parts if self.chat_output is not None else not text
        if held_back and finish_reason is None and self.detokenizer is not None:
            return None
        delta = Delta(self.index, text, self._unsent, finish_reason, parts,
                      self._unsent_logprobs if self.logprobs else None)
        self._unsent, self._unsent_logprobs = [], []
        return delta

    def _text(self, token_ids: list[int], finish_reason: str | None) -> tuple[str, list[int], int]:
        """The new text past the stop strings, (with logprobs) where each token's text starts in the decoded output,
        and how many of the tokens the choice keeps: all of them, or those up to the one whose text completes a stop
        string. With special tokens kept, the end-of-sequence (or stop_token_ids) token that stopped the output is
        left out of the text: it ends the message, it is not part of it (skipping special tokens drops it otherwise)."""
        if self.detokenizer is None:
            return "", [0] * len(token_ids), len(token_ids)
        ended_by_token = finish_reason == "stop" and self.keeps_special_tokens and bool(token_ids)
        text, starts, kept = self._decode(token_ids[:-1] if ended_by_token else token_ids)
        if self.stops.matched:
            return text, starts, kept
        if ended_by_token and self.logprobs:
            starts.append(self._decoded_chars)
        if finish_reason is not None:
            text += self.stops.add(self.detokenizer.flush())
        return text, starts, len(token_ids)

    def _decode(self, token_ids: list[int]) -> tuple[str, list[int], int]:
        """The text the tokens complete past the stop strings, where each one's text starts, and how many tokens were
        read: up to the first whose text completes a stop string. With logprobs or stop strings the tokens go into
        the detokenizer one at a time, so that each one's start, and the token a stop string ends on, are the same
        whatever batches they came in; with neither, they go in at once (no starts: nobody reads them)."""
        if not self.logprobs and not self.stops.stops:
            decoded = self.detokenizer.add(token_ids)
            self._decoded_chars += len(decoded)
            return self.stops.add(decoded), [], len(token_ids)
        pieces, starts = [], []
        for token in token_ids:
            starts.append(self._decoded_chars)
            decoded = self.detokenizer.add([token])
            self._decoded_chars += len(decoded)
            pieces.append(self.stops.add(decoded))
            if self.stops.matched:
                break
        return "".join(pieces), starts, len(starts)

    def _parts(self, text: str, finish_reason: str | None) -> list:
        if self.chat_output is None:
            return []
        parts = self.chat_output.feed(text) if text else []
        if finish_reason is not None:
            parts += self.chat_output.finish()
        return parts


class Generation:
    def __init__(self, worker: EngineWorker, stats: ServerStats, work, *, tokenizer, stops: list[str],
                 chat_output=None):
        """`work`: (prompt token ids, SamplingParams) per choice; `chat_output()` makes a choice's ChatOutput (chat
        completions; None: completions, plain text)."""
        self.worker = worker
        self.stats = stats
        self.ticket = Ticket(work)
        self.prompt_tokens = sum(len(prompt) for prompt, _ in work)
        self.choices = [_ChoiceText(i, tokenizer, stops, chat_output() if chat_output is not None else None,
                                    logprobs=params.logprobs is not None)
                        for i, (_, params) in enumerate(work)]
        self._unfinished = len(work)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    @property
    def completion_tokens(self) -> int:
        return sum(choice.num_tokens for choice in self.choices)

    async def submit(self) -> None:
        """Queue the requests in the engine; raises APIError 400 (a request the engine refused, with its reason)
        or 503 (the engine stopped)."""
        self.stats.pending += len(self.choices)
        self.worker.submit(self.ticket)
        try:
            event = await self.ticket.events.get()
        except BaseException:  # cancelled before the answer came: abort whatever gets queued
            self.close()
            raise
        if isinstance(event, Rejected):
            self._close_all(reason=None)
            raise Rejection(503 if event.engine_stopped else 400, event.message, event.index)
        self.stats.prompt_tokens += self.prompt_tokens

    async def deltas(self):
        """Yield a Delta each time a choice gains text or finishes, until every choice has finished. Leaving early
        (the consumer cancelled or closed this generator) closes the generation."""
        try:
            while self._unfinished:
                for index, tokens in (await self._next_tokens()).items():
                    choice = self.choices[index]
                    if choice.finish_reason is not None:
                        continue  # a stop string ended it here; this is the engine catching up
                    delta = choice.add(tokens.token_ids, tokens.finish_reason, tokens.logprobs)
                    if choice.finish_reason is not None:
                        self._finished(choice, still_in_engine=tokens.finish_reason is None)
                    if delta is not None:
                        yield delta
        finally:
            self.close()

    def close(self) -> None:
        """Abort the choices that have not finished (the engine frees them at its next step); a no-op once all have.
        Whoever started the generation calls it when done with it, however that ended: a response that never
        started streaming never runs `deltas`' cleanup."""
        if self._unfinished:
            self.worker.abort(self.ticket)
            self._close_all(reason="abort")

    async def _next_tokens(self) -> dict[int, Tokens]:
        """All the Tokens waiting (at least one), merged per choice: a consumer that falls behind the engine then
        sends fewer, larger chunks instead of falling further behind."""
        events = [await self.ticket.events.get()]
        while not self.ticket.events.empty():
            events.append(self.ticket.events.get_nowait())
        merged = {}
        for event in events:
            if isinstance(event, EngineStopped):
                raise APIError(503, event.message)
            earlier = merged.get(event.index)
            merged[event.index] = event if earlier is None else Tokens(
                event.index, earlier.token_ids + event.token_ids, event.finish_reason,
                None if event.logprobs is None else earlier.logprobs + event.logprobs)
        return merged

    async def collect(self) -> list[Choice]:
        choices = [Choice(c.index, logprobs=[] if c.logprobs else None) for c in self.choices]
        async for delta in self.deltas():
            choice = choices[delta.index]
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            choice.parts += delta.parts
            choice.finish_reason = delta.finish_reason
            if delta.logprobs is not None:
                choice.logprobs += delta.logprobs
        return choices

    def _finished(self, choice: _ChoiceText, still_in_engine: bool) -> None:
        if still_in_engine:  # a stop string ended it, which the engine does not know of: free the request there
            self.worker.abort(self.ticket, choice.index)
        self._unfinished -= 1
        self.stats.pending -= 1
        self.stats.finished[choice.finish_reason] += 1

    def _close_all(self, reason: str | None) -> None:
        """Account for the choices still open (reason None: they were never accepted)."""
        self.stats.pending -= self._unfinished
        if reason is not None:
            self.stats.finished[reason] += self._unfinished
        self._unfinished = 0
