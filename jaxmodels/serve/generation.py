"""One HTTP request's generation as the event loop sees it: engine requests in (one per choice), text out.

Each choice's tokens go through an incremental detokenizer and then the stop strings; a stop string ends the choice
here and aborts its engine request. A generation that ends early (client gone, error) aborts whatever is unfinished,
so the engine frees those slots and pages at its next step.
"""

import dataclasses

from jaxmodels.serve.detokenizer import IncrementalDetokenizer
from jaxmodels.serve.metrics import ServerStats
from jaxmodels.serve.protocol import APIError
from jaxmodels.serve.stop_strings import StopStrings
from jaxmodels.serve.worker import EngineStopped, EngineWorker, Rejected, Ticket


class Rejection(APIError):
    """The engine refused one of the requests (`choice`; None when the engine has stopped)."""

    def __init__(self, status: int, message: str, choice: int | None):
        super().__init__(status, message)
        self.choice = choice


@dataclasses.dataclass
class Delta:
    """What one choice gained: text to send, the tokens behind it, and the finish reason once it is done."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclasses.dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


class _ChoiceText:
    """Tokens -> text for one choice: detokenized incrementally, then cut at the first stop string. Tokens whose
    text is held back (an unfinished character, a possible stop string) wait to go out with it."""

    def __init__(self, index: int, tokenizer, stops: list[str]):
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(stops)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._unsent: list[int] = []

    def add(self, token_ids: list[int], finish_reason: str | None) -> Delta | None:
        """The delta to send now, or None while everything new is held back."""
        self.num_tokens += len(token_ids)
        self._unsent += token_ids
        text = ""
        if self.detokenizer is not None:
            text = self.stops.add(self.detokenizer.add(token_ids))
            if finish_reason is not None and not self.stops.matched:
                text += self.stops.add(self.detokenizer.flush())
        if self.stops.matched:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.stops.flush()
        self.finish_reason = finish_reason
        if not text and finish_reason is None and self.detokenizer is not None:
            return None
        delta, self._unsent = Delta(self.index, text, self._unsent, finish_reason), []
        return delta


class Generation:
    def __init__(self, worker: EngineWorker, stats: ServerStats, work, *, tokenizer, stops: list[str]):
        """`work`: (prompt token ids, SamplingParams) per choice."""
        self.worker = worker
        self.stats = stats
        self.ticket = Ticket(work)
        self.prompt_tokens = sum(len(prompt) for prompt, _ in work)
        self.choices = [_ChoiceText(i, tokenizer, stops) for i in range(len(work))]
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
                for index, (token_ids, finish_reason) in (await self._next_tokens()).items():
                    choice = self.choices[index]
                    if choice.finish_reason is not None:
                        continue  # a stop string ended it here; this is the engine catching up
                    delta = choice.add(token_ids, finish_reason)
                    if choice.finish_reason is not None:
                        self._finished(choice, still_in_engine=finish_reason is None)
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

    async def _next_tokens(self) -> dict[int, tuple[list[int], str | None]]:
        """All the Tokens waiting (at least one), merged per choice: a consumer that falls behind the engine then
        sends fewer, larger chunks instead of falling further behind."""
        events = [await self.ticket.events.get()]
        while not self.ticket.events.empty():
            events.append(self.ticket.events.get_nowait())
        merged = {}
        for event in events:
            if isinstance(event, EngineStopped):
                raise APIError(503, event.message)
            token_ids, _ = merged.get(event.index, ([], None))
            merged[event.index] = (token_ids + event.token_ids, event.finish_reason)
        return merged

    async def collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(len(self.choices))]
        async for delta in self.deltas():
            choice = choices[delta.index]
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            choice.finish_reason = delta.finish_reason
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
