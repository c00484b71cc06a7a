"""Compiling the buckets: a covering set before serving, the finer buckets in the background while it serves.

Each bucket (a prefill token count, a decode batch size) is a whole-model step program; compiling them all one after
another is what made a default start take minutes. The engine only needs the largest bucket of each kind to serve
anything (a smaller batch pads up to it), so those are compiled first, before the constructor returns. The others
then compile on a background thread, in an order that shrinks the padding fastest (`compile_order`), and each is
switched in once all its programs are compiled (`Runner.mark_ready`): the step path never compiles and never waits
for a compilation, it picks the smallest bucket that is ready. Outputs do not depend on the bucket: padding rows
and tokens touch only the null slot and page (the engine's padding invariant), and the tests compare tokens served
before and after the finer buckets are ready.

Modes (`Engine(warmup=...)`):
  * "background" (True, the default): the covering set, then the rest in the background;
  * "all": every bucket before serving (a multi-process job always does this: every process must pick the same
    bucket for a step, which background readiness, different on each process, would not guarantee);
  * "covering": the covering set only; `compile_remaining()` compiles the rest when called (tests use it to serve
    with the covering set alone, then with all buckets);
  * "none" (False): nothing before serving; each program compiles on its first use, on the step path (a quick way
    to run a few requests once, e.g. the CLI's `generate`).

A bucket is its forward program and greedy sampler. The samplers of sampled requests (temperature > 0) and of
requests that adjust their logits or ask for logprobs compile on demand, for every bucket at once
(`compile_on_demand`, engine.programs.ON_DEMAND): in "background" mode right after the start, otherwise when the
first request that needs them comes, which the engine holds until they are ready (never on the step path).

Lowering (tracing the model) holds the GIL and runs on one thread; XLA's compilation releases it and runs on a pool
of threads, so the programs of a set compile concurrently.
"""

import atexit
import concurrent.futures
import logging
import os
import sys
import threading
import time
import weakref

from jaxmodels.engine.programs import ON_DEMAND, ON_DEMAND_USES
from jaxmodels.step_context import StepKind

log = logging.getLogger("jaxmodels.engine")

MODES = ("background", "all", "covering", "none")
# The interpreter's switch interval while compiling in the background (see Warmup._compile_in_background).
BACKGROUND_SWITCH_INTERVAL_S = 0.0005
# Background compilations still running: stopped at exit, so that no XLA compilation outlives the interpreter.
_running: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for warmup in list(_running):
        warmup.stop()


def warmup_mode(warmup: bool | str) -> str:
    """`warmup` as given to the engine (True / False or a mode name) -> one of MODES."""
    mode = {True: "background", False: "none"}.get(warmup, warmup) if isinstance(warmup, bool) else warmup
    if mode not in MODES:
        raise ValueError(f"warmup must be True, False or one of {MODES}, got {warmup!r}")
    return mode


def compile_order(sizes: list[int]) -> list[int]:
    """Bucket sizes in the order to compile them: the largest (which covers every batch) first, then breadth-first
    bisection of the sorted list (its middle, then the middles of both halves, ...), so that with a geometric list
    the worst padding ratio shrinks as fast as it can."""
    sizes = sorted(sizes)
    order, spans = [sizes[-1]], [(0, len(sizes) - 1)]  # [low, high) index spans still to place
    while spans:
        next_spans = []
        for low, high in spans:
            if low < high:
                middle = (low + high) // 2
                order.append(sizes[middle])
                next_spans += [(low, middle), (middle + 1, high)]
        spans = next_spans
    return order


def _interleaved(*orders: list) -> list:
    """[a0, b0, a1, b1, ...] over lists of different lengths."""
    out = []
    for i in range(max(map(len, orders), default=0)):
        out += [order[i] for order in orders if i < len(order)]
    return out


def _timed_compile(lowered, lower_s: float) -> tuple:
    began = time.perf_counter()
    executable = lowered.compile()
    return executable, lower_s, time.perf_counter() - began


class Warmup:
    """The compilation of a runner's buckets (see the module docstring). `status` may be read from any thread; `stop`
    ends the background work after the programs compiling at that moment, and so does the end of `owner`."""

    def __init__(self, programs, mode: str, *, progress: bool, started: float | None = None, owner=None):
        """`programs`: the runner's StepPrograms (engine.programs); `started`: the `time.perf_counter()` the start is
        measured from (the LLM call, before the weights); `owner`: the object serving with them (the engine), held
        weakly, so that dropping it stops the background compilation (which holds no weights nor caches itself)."""
        self.programs, self.mode, self.progress = programs, mode, progress
        self._owner = weakref.ref(owner) if owner is not None else None
        self.started = started if started is not None else time.perf_counter()
        self.ready_s: float | None = None  # from `started` until the engine could serve
        self.remaining_s: float | None = None  # how long compiling the buckets after the covering set took
        self.failures: list[str] = []  # buckets left out: batches pad up past them
        # (job, seconds lowering, seconds compiling, before serving?) of each program compiled: where the start goes
        self.timings: list[tuple] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_demand: dict[str, threading.Thread] = {}  # compile_on_demand's, by kind
        self.on_demand_errors: dict[str, str] = {}
        kinds = (StepKind.EXTEND, StepKind.DECODE)
        self._covering = [(kind, programs.sizes_of(kind)[-1]) for kind in kinds]
        self._remaining = _interleaved(*[[(kind, n) for n in compile_order(programs.sizes_of(kind))[1:]]
                                         for kind in kinds])
        self._total = len(self._covering) + len(self._remaining)

    def start(self) -> None:
        """Compile what the mode asks for before serving; returns once the engine can serve."""
        if self.mode == "none":
            self.programs.compile_lazily()
        else:
            import jax

            both = self.mode == "all"
            # Several processes step together and must all hold every program a step may call: no samplers on demand.
            on_demand = [(kind, 0) for kind in ON_DEMAND] if jax.process_count() > 1 else []
            self._compile(self._covering + (self._remaining if both else []) + on_demand, required=True,
                          desc="compiling buckets" if both else "compiling the largest buckets",
                          threads=os.cpu_count() or 1)
            if both:
                self._remaining = []
        self.ready_s = time.perf_counter() - self.started
        log.info("ready to serve %.1f s after the start; buckets compiled: %s", self.ready_s,
                 {kind.name.lower(): sizes for kind, sizes in self.programs.ready_buckets().items()})
        if self.mode == "background":  # a server's first sampled (OpenAI's default) or logprobs request need not wait
            for kind in ON_DEMAND:
                self.compile_on_demand(kind)
        if self.mode == "background" and self._remaining:
            self._thread = threading.Thread(target=self._compile_in_background, name="jaxmodels-compile", daemon=True)
            _running.add(self)
            self._thread.start()

    def compile_on_demand(self, kind: str) -> None:
        """Start compiling the samplers of `kind` (engine.programs.ON_DEMAND) on a thread of their own, unless done
        or started: the engine holds the requests that need them until they are ready."""
        if self.programs.on_demand_ready[kind] or kind in self._on_demand:
            return

        def run():
            try:
                self._compile([(kind, 0)], required=True, desc=f"compiling the samplers for {ON_DEMAND_USES[kind]}",
                              threads=os.cpu_count() or 1)
            except Exception as error:  # noqa: BLE001 - reported to the requests waiting for it
                log.exception("compiling the samplers for %s failed", ON_DEMAND_USES[kind])
                self.on_demand_errors[kind] = f"{type(error).__name__}: {error}"

        self._on_demand[kind] = thread = threading.Thread(target=run, name=f"jaxmodels-compile-{kind}", daemon=True)
        thread.start()

    def wait_on_demand(self, kind: str) -> None:
        if kind in self._on_demand:
            self._on_demand[kind].join()

    def _compile_in_background(self) -> None:
        # Lowering is Python (tracing the model) and holds the GIL for seconds per program; a serving thread that
        # wants the GIL back waits the switch interval (5 ms by default) each time. Meanwhile the interval is short.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, BACKGROUND_SWITCH_INTERVAL_S))
        try:
            self.compile_remaining()
        except Exception:  # noqa: BLE001 - serving goes on with the buckets it has
            log.exception("background compilation stopped; serving goes on with the buckets compiled so far")
        finally:
            sys.setswitchinterval(switch_interval)
            _running.discard(self)

    def compile_remaining(self) -> None:
        """Compile the buckets left after the covering set, here, switching each in as soon as it is ready. In the
        background one core is left to serving: one compile thread fewer than the cores."""
        if not self._remaining:
            return
        start = time.perf_counter()
        threads = max(1, (os.cpu_count() or 1) - (self._thread is not None))
        self._compile(self._remaining, required=False, desc="compiling the other buckets (serving meanwhile)",
                      threads=threads)
        if not self._stop.is_set():
            self.remaining_s = time.perf_counter() - start
            log.info("compiled the other %d buckets in %.1f s", len(self._remaining), self.remaining_s)
            self._remaining = []

    def _compile(self, buckets: list[tuple], *, required: bool, desc: str, threads: int) -> None:
        """Compile every program of `buckets`, in their order, switching each bucket in once all its programs are
        compiled. Programs are lowered on this thread (that holds the GIL) and compiled on `threads` threads, at
        most one more in flight than threads, so that the order holds and lowered modules do not pile up. A failure
        raises if the buckets are `required`; otherwise its bucket stays out, with a warning."""
        from tqdm.auto import tqdm

        programs = self.programs
        waiting = {bucket: {job for job in programs.bucket_jobs(*bucket) if not programs.is_compiled(job)}
                   for bucket in buckets}
        queue = list(dict.fromkeys(job for bucket in buckets for job in programs.bucket_jobs(*bucket)
                                   if job in waiting[bucket]))
        in_flight = {}
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxmodels-xla") as pool, \
                tqdm(total=len(buckets), desc=desc, unit="bucket", disable=not self.progress) as bar:

            def failed(job, error):
                if required:
                    raise error
                message = f"compiling {job} failed ({type(error).__name__}: {error})"
                log.warning("%s; its bucket stays out: batches pad up past it", message)
                self.failures.append(message)
                for bucket in [bucket for bucket, jobs in waiting.items() if job in jobs]:
                    del waiting[bucket]
                    bar.update()

            while True:
                for bucket in [bucket for bucket, jobs in waiting.items() if not jobs]:
                    del waiting[bucket]
                    programs.mark_ready(*bucket)
                    bar.update()
                while queue and len(in_flight) <= threads and not self._stopping():
                    job = queue.pop(0)
                    began = time.perf_counter()
                    try:
                        lowered = programs.lower(job)
                    except Exception as error:
                        failed(job, error)
                        continue
                    try:
                        in_flight[pool.submit(_timed_compile, lowered, time.perf_counter() - began)] = job
                    except RuntimeError:  # the interpreter is exiting: its thread pools take no more work
                        self._stop.set()
                if not in_flight:
                    return
                done, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    job = in_flight.pop(future)
                    try:
                        executable, lower_s, compile_s = future.result()
                    except Exception as error:
                        failed(job, error)
                        continue
                    programs.store_compiled(job, executable)
                    self.timings.append((job, lower_s, compile_s, required))
                    for jobs in waiting.values():
                        jobs.discard(job)

    def _stopping(self) -> bool:
        if self._owner is not None and self._owner() is None:
            self._stop.set()  # nobody serves with these programs any more
        return self._stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background compilation has ended (True), or `timeout` seconds passed (False)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def stop(self) -> None:
        """End the background compilation after the programs compiling now; no new one starts."""
        self._stop.set()
        self.wait()

    def status(self) -> dict:
        """Seconds from the start to ready (None before), buckets ready and still to compile, and how long the
        background compilation took (None until it ends)."""
        ready = sum(map(len, self.programs.ready_buckets().values()))
        compiling = 0 if self.mode == "none" else self._total - ready - len(self.failures)
        return dict(ready_s=self.ready_s, buckets_ready=ready, buckets_compiling=max(compiling, 0),
                    background_compile_s=self.remaining_s)
