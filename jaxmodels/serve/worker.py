"""The engine thread: the only thread that calls the Engine (it is not thread-safe).

The event loop hands it commands through a thread-safe queue (submit a ticket, abort one, run a function such as a
metrics snapshot); the thread steps the engine while there is work and sleeps on the queue when there is none. What
it has for the event loop (acceptances, rejections, new tokens) goes back in one batch per step through
`loop.call_soon_threadsafe`, into each ticket's asyncio.Queue.
"""

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import time

from jaxmodels.engine.engine import InvalidRequest
from jaxmodels.engine.request import SamplingParams
from jaxmodels.serve.metrics import ThroughputWindow

log = logging.getLogger("jaxmodels.serve")


@dataclasses.dataclass
class Accepted:
    """Every request of the ticket is queued in the engine."""


@dataclasses.dataclass
class Rejected:
    message: str
    index: int | None = None  # the ticket's request the engine refused; None when the engine stopped
    engine_stopped: bool = False


@dataclasses.dataclass
class Tokens:
    index: int  # the ticket's request (choice) they belong to
    token_ids: list[int]  # new since the last Tokens of this request
    finish_reason: str | None  # "stop", "length" or "abort" once the request finished
    # With SamplingParams.logprobs, one per token: (its logprob, [(token id, logprob)] of the most likely ones).
    logprobs: list | None = None


@dataclasses.dataclass
class EngineStopped:
    message: str


@dataclasses.dataclass(eq=False)
class Ticket:
    """The engine requests of one HTTP request (one per choice). The engine thread fills `events` only through the
    event loop; `request_ids` belongs to the engine thread."""

    work: list[tuple[list[int], SamplingParams]]
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    request_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Route:
    ticket: Ticket
    index: int
    delivered: int = 0  # output tokens already sent


class EngineWorker:
    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop
        self.failure: str | None = None  # set when the engine raised; the worker then refuses all work
        self.throughput = ThroughputWindow()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: list[tuple[Ticket, object]] = []
        self._routes: dict[int, _Route] = {}  # by engine request id, until the request finishes
        self._thread = threading.Thread(target=self._run, name="jaxmodels-engine", daemon=True)

    # Called from the event loop (or any thread).

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    def submit(self, ticket: Ticket) -> None:
        """Queue the ticket's requests; its events get Accepted or Rejected, then Tokens."""
        self._send(functools.partial(self._add, ticket), functools.partial(self._refuse_ticket, ticket))

    def abort(self, ticket: Ticket, index: int | None = None) -> None:
        """Abort one request of the ticket (all when index is None); they free their slots and pages at the next
        step boundary. Finished ones are left alone."""
        self._send(functools.partial(self._abort, ticket, index), lambda: None)

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() on the engine thread between two steps (the engine is not safe to read from elsewhere)."""
        future = concurrent.futures.Future()
        self._send(functools.partial(_run_into, future, fn),
                   lambda: future.set_exception(RuntimeError(self.failure)))
        return future

    def _send(self, run, refuse) -> None:
        """Queue a command: `run` on the engine thread, or `refuse` there once the engine has failed."""
        self._inbox.put((run, refuse))

    def snapshot(self) -> dict:
        """The engine's metrics and the recent output rate; run it through `call`."""
        return {**self.engine.metrics(), "tokens_per_s": self.throughput.rate(time.monotonic())}

    # The engine thread.

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as e:  # the engine's state is unknown now: fail everything in flight, refuse the rest
            log.exception("the engine thread failed")
            self.failure = f"the engine stopped: {type(e).__name__}: {e}"
            self._stop_all(self.failure)
            self._refuse_all()
        else:
            self._stop_all("the server is shutting down")

    def _serve(self) -> None:
        engine = self.engine
        while True:
            # Sleep on the queue while the engine is idle; while it works, take what has arrived between steps.
            commands = [] if engine.has_work() else [self._inbox.get()]
            commands += _drain(self._inbox)
            for command in commands:
                if command is None:
                    return
                run, _ = command
                run()
            if engine.has_work():
                self._account(engine.step())
            self._post()

    def _add(self, ticket: Ticket) -> None:
        ids = []
        for index, (prompt, params) in enumerate(ticket.work):
            try:
                ids.append(self.engine.add_request(prompt, params).request_id)
            except InvalidRequest as e:
                for request_id in ids:  # all or nothing: the ones already queued go again
                    self.engine.abort(request_id)
                self._outbox.append((ticket, Rejected(str(e), index)))
                return
        ticket.request_ids = ids
        for index, request_id in enumerate(ids):
            self._routes[request_id] = _Route(ticket, index)
        self._outbox.append((ticket, Accepted()))

    def _refuse_ticket(self, ticket: Ticket) -> None:
        self._outbox.append((ticket, Rejected(self.failure, engine_stopped=True)))

    def _abort(self, ticket: Ticket, index: int | None) -> None:
        ids = ticket.request_ids if index is None else ticket.request_ids[index:index + 1]
        for request_id in ids:
            if request_id in self._routes:
                self.engine.abort(request_id)

    def _account(self, requests) -> None:
        generated = 0
        for request in requests:
            route = self._routes.get(request.request_id)
            if route is None:
                continue  # a request aborted because another of its ticket was rejected
            new = request.output[route.delivered:]
            logprobs = (request.logprobs[route.delivered:route.delivered + len(new)]
                        if request.params.logprobs is not None else None)
            route.delivered += len(new)
            generated += len(new)
            finish_reason = request.finish_reason if request.finished else None
            if finish_reason is not None:
                del self._routes[request.request_id]
            self._outbox.append((route.ticket, Tokens(route.index, new, finish_reason, logprobs)))
        self.throughput.add(time.monotonic(), generated)

    def _post(self) -> None:
        if not self._outbox:
            return
        events, self._outbox = self._outbox, []
        try:
            self.loop.call_soon_threadsafe(_deliver, events)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def _stop_all(self, message: str) -> None:
        tickets = {id(route.ticket): route.ticket for route in self._routes.values()}
        self._routes.clear()
        self._outbox.extend((ticket, EngineStopped(message)) for ticket in tickets.values())
        self._post()

    def _refuse_all(self) -> None:
        while (command := self._inbox.get()) is not None:
            _, refuse = command
            refuse()
            self._post()


def _drain(inbox: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def _deliver(events) -> None:
    for ticket, event in events:
        ticket.events.put_nowait(event)


def _run_into(future: concurrent.futures.Future, fn) -> None:
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)
