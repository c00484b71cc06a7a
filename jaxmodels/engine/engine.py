"""The serving loop: validate, schedule, send one executable to the device, account for the sampled tokens; repeat.

With overlapped scheduling (the default) step N+1 is scheduled and sent before step N's tokens are read back: JAX
dispatch is asynchronous, so the host's scheduling and batch building run while the device computes, and the device
finds the next step queued when it finishes one. Decode inputs come from the device-side last token of each slot, so
nothing waits for the host. Outputs are the same as without overlap: stop conditions are applied when the tokens
arrive (a request that stopped may run one extra step whose token is dropped), and a preemption, which recomputes a
request from its tokens, first settles the step in flight.

With speculative decoding (`num_speculative_tokens` k > 0, see engine.speculative) every decode step is a VERIFY
step that yields 1 to k+1 tokens per request. The device keeps each slot's position and drafts, so verify steps
overlap too; the host learns how many tokens a step gave when it reads it, one step later.
"""

import concurrent.futures
import dataclasses
import logging
import random
import threading
import time

import jax
import numpy as np

from jaxmodels.engine.buckets import decode_buckets, prefill_buckets
from jaxmodels.engine.cache import PoolSizes, free_device_memory, pages_within, reports_memory, total_bytes
from jaxmodels.engine.grammar import GrammarCompiler, GrammarMatcher, fill_next_masks
from jaxmodels.engine.request import (BIAS_ENTRIES, Request, RequestStatus, SamplingParams, prompt_problems,
                                      stop_tokens)
from jaxmodels.engine.runner import Runner
from jaxmodels.engine.scheduler import GroupedScheduler
from jaxmodels.engine.step import ModelStep
from jaxmodels.engine.warmup import Warmup, warmup_mode
from jaxmodels.step_context import StepKind

log = logging.getLogger("jaxmodels.engine")

MAX_SPECULATIVE_TOKENS = 8
DEFAULT_MEMORY_FRACTION = 0.9  # of the device memory free after the weights, at most, for default-sized pools
DEFAULT_MAX_SEQ_LEN = 4096  # unless the model's positions end sooner; longer contexts are asked for explicitly
# Recurrent-state restores (and saves) an extend step carries with prefix caching; a request whose restore does not
# fit waits a step. Each copies a request's whole state on every extend step, padding included (8 restores and 8
# saves move 4.6 GB at the Nano-9B class's 143 MB of state, ~1 ms of an extend step's tens). With 4, the 64
# conversations of the multi-turn benchmark resuming at once need 16 extend steps where their tokens fill 11 (by
# count; not yet profiled).
STATE_COPIES_PER_STEP = 8
# At most this share of the pools' memory budget goes to the default number of state snapshots.
SNAPSHOT_MEMORY_SHARE = 0.25


def _fraction(memory_fraction: float | None) -> float:
    """The share of the device memory left after the weights that the pools may take."""
    fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    if not 0 < fraction < 1:
        raise ValueError(f"memory_fraction must be in (0, 1), got {memory_fraction}")
    return fraction


def default_snapshots(group_batch: int) -> int:
    """Recurrent-state snapshots a hybrid keeps for prefix caching by default, per dp group: one for each request
    slot (a conversation's latest prompt, where its next turn resumes) and a quarter more for prefixes that prompts
    share (a system prompt's end). With only one per slot, 64 conversations of a shared system prompt lost a third
    of their hits on the 2-core CPU's multi-turn run: every turn evicted the snapshot of a conversation not yet back."""
    return group_batch + -(-group_batch // 4)


class InvalidRequest(ValueError):
    """A request rejected before it reached the device; the message names what is wrong."""


@dataclasses.dataclass
class _InFlight:
    kind: StepKind
    works: list  # per dp group, the scheduler's chunks or requests ([] for an idle group)
    tokens: object  # device array of the sampled tokens, not yet read: rows_per_group rows per group
    rows_per_group: int


@dataclasses.dataclass
class StepTimes:
    """Cumulative counters of the serving loop (see Engine.metrics)."""

    steps: int = 0
    extend_steps: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0  # time inside Engine.step
    wait_s: float = 0.0  # of which blocked on the device's tokens
    spec_draft_tokens: int = 0  # drafts checked by VERIFY steps (k per request and step)
    spec_accepted_tokens: int = 0  # of which accepted
    spec_rejections: int = 0  # verify rows where a draft was turned down (the drafts after it were not judged)


def _attach_logprobs(step, got: list[Request], chosen, top_ids, top_logprobs) -> None:
    """Give each request of `got` that asks for logprobs those of the token it just got (row r of its group's part
    of the step's arrays: its chunk's or its own)."""
    got = {request.request_id for request in got}
    for g, work in enumerate(step.works):
        for r, item in enumerate(work):
            request = item.request if step.kind is StepKind.EXTEND else item
            k = request.params.logprobs
            if k is None or request.request_id not in got:
                continue
            row = g * step.rows_per_group + r
            request.logprobs.append((float(chosen[row]),
                                     list(zip(top_ids[row, :k].tolist(), top_logprobs[row, :k].tolist()))))


def _constrained_rows(kind: StepKind, works: list, rows_per_group: int) -> list[tuple[Request, int]]:
    """(request, row) of a step's rows that draw a token under a grammar (an extend chunk only where it ends the
    request's known tokens: the others' tokens are dropped)."""
    out = []
    for g, work in enumerate(works):
        for r, item in enumerate(work):
            request = item.request if kind is StepKind.EXTEND else item
            if request.grammar is not None and (kind is not StepKind.EXTEND
                                                or item.start + item.length == len(request.token_ids)):
                out.append((request, g * rows_per_group + r))
    return out


def _abort_unscheduled(request: Request) -> None:
    """End a request the scheduler never had (held for its samplers) with "abort"."""
    request.finish_reason, request.status = "abort", RequestStatus.FINISHED


class Engine:
    def __init__(self, model, *, max_batch_size: int, max_seq_len: int | None = None,
                 max_prefill_tokens: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 warmup: bool | str = True, progress: bool = True, started: float | None = None,
                 prefill_sizes: list[int] | None = None, decode_sizes: list[int] | None = None, mesh=None,
                 memory_fraction: float | None = None, overlap: bool = True, mamba_ssm_cache_dtype=None,
                 matmul_precision: str | None = None, num_speculative_tokens: int = 0,
                 launch_thread: bool | None = None, enable_prefix_caching: bool = True,
                 mamba_cache_slots: int | None = None, tokenizer=None):
        """`max_seq_len` (prompt plus output tokens of one request) may go up to the model's
        `max_position_embeddings` (the YaRN-extended length where the config has YaRN); by default
        min(DEFAULT_MAX_SEQ_LEN, that).

        `prefill_sizes` / `decode_sizes` replace the default bucket lists (fewer buckets compile faster; the
        largest prefill bucket is the per-step token budget, the largest decode one must be max_batch_size).

        Pages: `num_pages` if given; else, with `memory_fraction`, as many as fit in that fraction of the device
        memory still free after the weights (the rest is left for activations and compilation); else enough for
        max_batch_size requests of max_seq_len tokens, or on a device that reports its memory as many of those as
        fit in DEFAULT_MEMORY_FRACTION of it.

        On a `mesh` with a "dp" axis of size dp, each data-parallel group serves max_batch_size / dp requests from
        its own pools: `num_pages`, `decode_sizes` and `prefill_sizes` are per group (see engine.runner).

        `warmup`: True (or "background") compiles the largest bucket of each kind before returning and the others
        on a background thread while serving, switching each in when it is ready; "all" compiles every bucket
        before returning (a multi-process job always does); "covering" compiles the largest ones only, until
        `compile_remaining()`; False (or "none") compiles each program on first use (see engine.warmup).
        `started` (a time.perf_counter()) is when the start began, for `metrics()["ready_s"]` (default: now).

        `overlap=False` reads every step's tokens before scheduling the next (same outputs, slower).
        `launch_thread` sends each step's transfers and executables from a thread of their own, so this one reads
        and accounts for the step before while the next is being launched (same outputs; None: on unless the job has
        several processes; see engine.runner).
        `mamba_ssm_cache_dtype` overrides the config's SSM state dtype (e.g. "bfloat16" halves the state traffic).
        `matmul_precision` overrides the precision the model's dtype implies (see jaxmodels.precision).
        `num_speculative_tokens` k > 0 drafts k tokens per step with the model's MTP layers and verifies them in one
        step (lossless: greedy outputs are the same, sampled ones have the same distribution).
        `enable_prefix_caching` keeps computed pages after their requests and starts a request that begins with
        cached tokens after them (engine.prefix_cache); a hybrid (Mamba) model resumes from state snapshots, of
        which it keeps `mamba_cache_slots` per dp group (default: `default_snapshots`, 1.25 per request slot, and
        where pools are sized by memory at most SNAPSHOT_MEMORY_SHARE of it; each costs what a request's state
        does, taken from the pages' memory).
        `tokenizer` (a `tokenizers.Tokenizer`): the one structured output compiles its grammars for (requests with
        SamplingParams.structured_output are refused without it).
        """
        positions = model.config.max_position_embeddings
        max_seq_len = max_seq_len if max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, positions)
        if max_seq_len > positions:
            raise ValueError(f"max_seq_len={max_seq_len} is past the model's max_position_embeddings={positions}: "
                             "positions beyond it were never trained (nor covered by the config's rope scaling)")
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        dp = mesh.shape["dp"] if mesh is not None else 1
        if max_batch_size % dp:
            raise ValueError(f"max_batch_size={max_batch_size} must be a multiple of dp={dp}: each data-parallel "
                             "group serves max_batch_size / dp requests")
        if not isinstance(num_speculative_tokens, int) or not 0 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an int in [0, {MAX_SPECULATIVE_TOKENS}] (0: off), got "
                             f"{num_speculative_tokens!r}")
        group_batch = max_batch_size // dp
        self.config = model.config
        self.max_seq_len = max_seq_len
        self.num_speculative_tokens = k = num_speculative_tokens
        self.overlap = overlap
        prefill_sizes = sorted(prefill_sizes or prefill_buckets(max_prefill_tokens or min(max_seq_len, 1024)))
        decode_sizes = sorted(decode_sizes or decode_buckets(group_batch))
        if decode_sizes[-1] != group_batch:
            raise ValueError(f"the largest decode bucket must be max_batch_size / dp = {group_batch}: {decode_sizes}")
        max_prefill_tokens = prefill_sizes[-1]
        step = ModelStep(model, mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, matmul_precision=matmul_precision,
                         num_speculative_tokens=k)
        recurrent = step.recurrent
        if mamba_cache_slots is not None and (not isinstance(mamba_cache_slots, int) or mamba_cache_slots < 0):
            raise ValueError(f"mamba_cache_slots must be an int >= 0, got {mamba_cache_slots!r}")
        snapshots = 0
        if enable_prefix_caching and recurrent:
            snapshots = default_snapshots(group_batch) if mamba_cache_slots is None else mamba_cache_slots
        self.prefix_caching = enable_prefix_caching
        # Pools per dp group: each group's slice of the (dp-split) caches is a whole pool with its null page / slot.
        # A verify step writes up to 2k positions past a request's last token, which may be k+1 past what the host
        # knows while the step before it is in flight (see Scheduler._verify_batch): the page-table rows reach that
        # far.
        row_len = max_seq_len + 3 * k + 1 if k else max_seq_len
        self.sizes = PoolSizes.from_limits(max_batch_size=group_batch, max_seq_len=row_len,
                                           page_size=page_size, num_pages=num_pages, num_snapshots=snapshots)
        devices = list(mesh.devices.flat) if mesh is not None else None
        # Without a memory fraction, pools are capped by memory only in a one-process job: the processes of a
        # multi-process one may see different free memory, and their pools must have the same shapes.
        capped = jax.process_count() == 1 and reports_memory(devices)
        if mamba_cache_slots is None and snapshots and (memory_fraction is not None or capped):
            snapshots = self._snapshots_for_memory(step, memory_fraction, devices)
            self.sizes = dataclasses.replace(self.sizes, num_snapshots=snapshots)
        state_copies = min(STATE_COPIES_PER_STEP, snapshots)
        pages = self.sizes.num_pages
        if num_pages is None and (memory_fraction is not None or capped):
            pages = self._pages_for_memory(step, memory_fraction, devices)
        if pages != self.sizes.num_pages:
            self.sizes = PoolSizes.from_limits(max_batch_size=group_batch, max_seq_len=row_len, page_size=page_size,
                                               num_pages=pages, num_snapshots=snapshots)
        log.info("engine limits: max_batch_size=%d max_seq_len=%d max_prefill_tokens=%d; pools of each of %d dp "
                 "group(s): %d KV pages of %d tokens (page 0 null), %d state slots (slot 0 null), %d state "
                 "snapshots; prefix caching %s", max_batch_size, max_seq_len, max_prefill_tokens, dp,
                 self.sizes.num_pages, page_size, self.sizes.num_slots, snapshots,
                 "on" if enable_prefix_caching else "off")
        self.scheduler = GroupedScheduler(self.sizes, dp, max_batch_size=group_batch,
                                          max_prefill_tokens=max_prefill_tokens, max_seq_len=max_seq_len,
                                          num_speculative_tokens=k, prefix_caching=enable_prefix_caching,
                                          recurrent=recurrent, state_copies=state_copies)
        self.runner = Runner(step, self.sizes, decode_sizes=decode_sizes, prefill_sizes=prefill_sizes,
                             max_seqs_per_extend=group_batch, mesh=mesh, launch_thread=launch_thread,
                             state_copies=state_copies)
        mode = warmup_mode(warmup)
        if mode == "background" and jax.process_count() > 1:
            mode = "all"  # every process must pick the same bucket for a step: see engine.warmup
        self.warmup = Warmup(self.runner.programs, mode, progress=progress, started=started, owner=self)
        self.warmup.start()
        self.eos_ids = frozenset(self.config.eos_token_id)
        self.tokenizer = tokenizer
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self._next_id = 0
        self._seeds = random.Random(0)
        self._live: dict[int, Request] = {}  # unfinished requests by id
        self._aborts: set[int] = set()
        self._inflight: list[_InFlight] = []
        self._held: list[Request] = []  # requests waiting for the samplers they need to compile (ON_DEMAND)
        self.last_launch: tuple[StepKind, int] | None = None  # (kind, rows) of the last step the last step() sent
        self.times = StepTimes()

    def _snapshots_for_memory(self, step, memory_fraction, devices) -> int:
        """The default snapshot count (`self.sizes`), lowered to what SNAPSHOT_MEMORY_SHARE of the pools' memory
        budget holds: a default must not leave a large batch too few pages, or fail where it fit before."""
        budget = _fraction(memory_fraction) * free_device_memory(devices)
        per_snapshot = (total_bytes(step.cache_shapes(dataclasses.replace(self.sizes, num_snapshots=1)))
                        - total_bytes(step.cache_shapes(dataclasses.replace(self.sizes, num_snapshots=0))))
        fit = int(SNAPSHOT_MEMORY_SHARE * budget // per_snapshot)
        if fit < self.sizes.num_snapshots:
            log.info("prefix caching keeps %d state snapshots of %.0f MiB (%d%% of the pools' memory) instead of %d; "
                     "mamba_cache_slots sets the count", fit, per_snapshot / 2**20, 100 * SNAPSHOT_MEMORY_SHARE,
                     self.sizes.num_snapshots)
        return min(fit, self.sizes.num_snapshots)

    def _pages_for_memory(self, step, memory_fraction, devices) -> int:
        """Pages (null page included) in `memory_fraction` of the memory left after the weights; without one, the
        pages of the full pools (`self.sizes`: max_batch_size requests of max_seq_len) capped at
        DEFAULT_MEMORY_FRACTION of it (a long max_seq_len then shares fewer pages among the requests, which the
        scheduler handles by waiting or preempting)."""
        fraction = _fraction(memory_fraction)
        # A device holds its group's pools; sized as if they were whole on it: safe, if low, where KV pages split
        # over tp.
        pages = pages_within(int(fraction * free_device_memory(devices)), step.cache_shapes, self.sizes)
        if memory_fraction is None and pages < self.sizes.num_pages:
            log.warning("%d KV pages of %d tokens fit in %.0f%% of the free device memory, fewer than %d requests of "
                        "%d tokens would take; they share them (pass num_pages or memory_fraction to choose)",
                        pages - 1, self.sizes.page_size, 100 * fraction, self.sizes.num_slots - 1,
                        self.sizes.pages_per_seq * self.sizes.page_size)
        return pages if memory_fraction is not None else min(pages, self.sizes.num_pages)

    def add_request(self, prompt, params: SamplingParams) -> Request:
        """Queue a request; raises InvalidRequest (touching no state) when the prompt or its params are bad."""
        prompt = [int(t) if hasattr(t, "__index__") else t for t in prompt]
        problems = prompt_problems(prompt, vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len)
        problems += params.problems() or self._adjustment_problems(params)
        if problems:
            raise InvalidRequest("; ".join(problems))
        grammar = self._grammar_matcher(params.structured_output) if params.structured_output is not None else None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        request = Request(self._next_id, prompt, params, seed, eos_ids=self.eos_ids, grammar=grammar)
        self._next_id += 1
        self._live[request.request_id] = request
        samplers = self.runner.programs.samplers_for(params)
        if samplers is not None and not self.runner.programs.on_demand_ready[samplers]:
            self.warmup.compile_on_demand(samplers)
            self._held.append(request)  # until its sampler is compiled (see _release_held)
        else:
            self.scheduler.add(request)
        return request

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured output's compiler for this model's tokenizer, built on first use (about a second for a 128k
        vocabulary; thread-safe: a server compiles each request's grammar off its event loop, before add_request,
        which then finds it in the compiler's cache)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise InvalidRequest("structured output needs the model's tokenizer (a tokenizer.json in the "
                                         "checkpoint directory)")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab_size=self.config.vocab_size,
                                                         eos_token_ids=self.eos_ids)
            return self._grammar_compiler

    def _grammar_matcher(self, spec) -> GrammarMatcher:
        try:
            return self.grammar_compiler.matcher(spec)
        except ValueError as error:
            raise InvalidRequest(f"structured_output: {error}") from None

    def _release_held(self) -> list[Request]:
        """Queue the requests held for a sampler compiled on demand (engine.programs.ON_DEMAND) once it is ready,
        waiting for it when there is nothing else to run; if compiling it failed, they end with "abort". Returns
        those that ended."""
        if not self._held:
            return []
        programs, warmup = self.runner.programs, self.warmup
        if not self.scheduler.has_work() and not self._inflight:
            warmup.wait_on_demand(programs.samplers_for(self._held[0].params))
        still, ended = [], []
        for request in self._held:
            samplers = programs.samplers_for(request.params)
            if samplers in warmup.on_demand_errors:
                _abort_unscheduled(request)
                ended.append(request)
            elif programs.on_demand_ready[samplers]:
                self.scheduler.add(request)
            else:
                still.append(request)
        self._held = still
        return ended

    def _adjustment_problems(self, params: SamplingParams) -> list[str]:
        """What this engine cannot do of `params`' logit adjustments and logprobs."""
        if not params.adjusted:
            return []
        if self.num_speculative_tokens:
            return ["penalties, logit_bias, min_tokens, logprobs and structured output are not supported with "
                    "speculative decoding (num_speculative_tokens > 0)"]
        out = []
        if any(token >= self.config.vocab_size for token in params.logit_bias or {}):
            out.append(f"logit_bias has a token id outside the vocabulary [0, {self.config.vocab_size})")
        stops = len(stop_tokens(params, self.eos_ids)) if params.min_tokens else 0
        if len(params.logit_bias or {}) + stops > BIAS_ENTRIES:
            out.append(f"logit_bias has {len(params.logit_bias)} entries and min_tokens holds back {stops} stop "
                       f"tokens: at most {BIAS_ENTRIES} together")
        return out

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step boundary: its slot and pages are freed, and the next `step()` returns it
        with finish_reason "abort". Unknown or finished ids are ignored."""
        self._aborts.add(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight) or bool(self._aborts) or bool(self._held)

    def step(self) -> list[Request]:
        """Run one step; returns the requests that received a token (or finished) in it.

        With overlap, "this step" sends step N+1 to the device and accounts for step N's tokens.
        """
        start = time.perf_counter()
        updated = self._apply_aborts()
        updated += self._release_held()
        if self.scheduler.blocked and self._inflight:
            updated += self._collect()  # a group waits to preempt, which needs every token on the host
        steps = self.scheduler.schedule(can_preempt=not self._inflight)
        if not steps and self._inflight:
            # Nothing can run until the tokens in flight are known (or running would need a preemption, which
            # recomputes a request from its tokens): settle the steps in flight, then decide.
            updated += self._collect()
            steps = self.scheduler.schedule()
        if not steps and self.scheduler.has_work():
            raise RuntimeError("scheduler stalled with work left and nothing in flight; the pool is too small")
        launched, masks = [], []
        try:
            for kind, works in steps:
                prepared = self.runner.prepare(kind, works, self.scheduler.tables())
                rows = _constrained_rows(kind, works, prepared.rows) if prepared.adjusted else []
                bitmask = None
                if rows:
                    # The masks need every token before this step's on the host. The launch thread sends the
                    # forward and waits for them; they are computed below, after the steps in flight are read.
                    bitmask = concurrent.futures.Future()
                    masks.append((bitmask, rows, len(works) * prepared.rows))
                    if not self.runner.launches_in_background:  # this thread launches: the masks come first
                        updated += self._collect()
                        self._fill_masks(masks[-1])
                launched.append(_InFlight(kind, works, self.runner.send(prepared, bitmask), prepared.rows))
                self._count(kind, works)
            self.last_launch = (steps[-1][0], sum(map(len, steps[-1][1]))) if steps else None
            updated += self._collect()  # waits for the previous steps; the ones just sent are queued behind them
            for pending in masks:
                if not pending[0].done():
                    self._fill_masks(pending)
        except BaseException as error:
            for bitmask, *_ in masks:  # the launch thread must not wait for them forever
                if not bitmask.done():
                    bitmask.set_exception(error)
            raise
        self._inflight = launched
        if not self.overlap:
            updated += self._collect()
        for request in updated:
            if request.finished:
                self._live.pop(request.request_id, None)
        self.times.wall_s += time.perf_counter() - start
        return updated

    def _fill_masks(self, pending) -> None:
        """Complete a step's bitmask future: each constrained row's next mask (its matcher has every token before
        it), every token allowed in the other rows."""
        bitmask, rows, total = pending
        compiler = self.grammar_compiler
        array = np.full((total, compiler.mask_words), -1, np.int32)
        fill_next_masks(compiler, [(request.grammar, row) for request, row in rows if not request.finished], array)
        bitmask.set_result(array)

    def _apply_aborts(self) -> list[Request]:
        aborted = []
        for request_id in self._aborts:
            request = self._live.get(request_id)
            if request in self._held:
                self._held.remove(request)
                _abort_unscheduled(request)
                aborted.append(request)
            elif request is not None and self.scheduler.abort(request):
                aborted.append(request)
        self._aborts.clear()
        return aborted

    def _collect(self) -> list[Request]:
        inflight, self._inflight = self._inflight, []
        got = []
        for step in inflight:
            start = time.perf_counter()
            sampled = self.runner.read(step.tokens)
            self.times.wait_s += time.perf_counter() - start
            logprobs = None
            if isinstance(sampled, tuple):  # the adjusting sampler's: tokens, then their logprobs
                sampled, *logprobs = sampled
            rows = step.rows_per_group
            per_group = [sampled[g * rows: g * rows + len(work)].tolist() for g, work in enumerate(step.works)]
            if step.kind is StepKind.VERIFY:  # drafts of requests still running (not of a finished one's extra step)
                live = [result for work, results in zip(step.works, per_group)
                        for request, result in zip(work, results) if not request.finished]
                self.times.spec_draft_tokens += self.num_speculative_tokens * len(live)
                self.times.spec_accepted_tokens += sum(result[-1] for result in live)
                self.times.spec_rejections += sum(result[-1] < self.num_speculative_tokens for result in live)
            before = self.scheduler.num_generated
            got_now = self.scheduler.finish(step.kind, step.works, per_group)
            self.times.generated_tokens += self.scheduler.num_generated - before
            if logprobs is not None:
                _attach_logprobs(step, got_now, *logprobs)
            got += got_now
        return got

    def _count(self, kind: StepKind, works) -> None:
        self.times.steps += 1
        if kind is StepKind.EXTEND:
            self.times.extend_steps += 1
        else:  # DECODE or VERIFY
            self.times.decode_steps += 1
            self.times.decode_rows += sum(map(len, works))

    def metrics(self) -> dict:
        """Counters since start (or since `reset_metrics`), and the pools' state now.

        host_s_per_step: time the loop spends on the host per step (scheduling, batches, dispatch, accounting), i.e.
        inside step() but not blocked on the device (with a launch thread, dispatch is that thread's and waiting for
        it counts as blocked); with overlap it runs while the device computes, so what matters is that it stays
        below the device's step time. wall_s_per_step: time per step as the caller sees it; with overlap and host
        time below device time, that is the device's step time. kv_pages_used: pages that running requests hold
        (cached pages among them). prompt_tokens / prefix_cache_hit_tokens: tokens that admitted requests needed in
        the caches, and of those the ones found cached (cumulative, never reset); prefix_cache_pages /
        prefix_cache_idle_pages / prefix_cache_snapshots: pages in the prefix cache, those of them no running
        request holds (free for the pool to take back), and its recurrent-state snapshots. ready_s: seconds from
        the start (the LLM call, weights included) until it could serve; buckets_ready / buckets_compiling: step
        programs' buckets usable now and still to compile; background_compile_s: how long compiling the others took
        (None until done).
        """
        t, counts = self.times, self.scheduler.counts()
        steps = max(t.steps, 1)
        host = t.wall_s - t.wait_s
        groups = len(self.scheduler.groups)
        pages, slots = groups * (self.sizes.num_pages - 1), groups * (self.sizes.num_slots - 1)
        return dict(
            running=counts["running"], waiting=counts["waiting"] + len(self._held), steps=t.steps,
            extend_steps=t.extend_steps,
            decode_steps=t.decode_steps, mean_decode_batch=t.decode_rows / max(t.decode_steps, 1),
            generated_tokens=t.generated_tokens, host_s_per_step=host / steps, wall_s_per_step=t.wall_s / steps,
            host_fraction=host / t.wall_s if t.wall_s else 0.0, preemptions=self.scheduler.num_preemptions,
            kv_pages_used=pages - counts["free_pages"], kv_pages_total=pages,
            slots_used=slots - counts["free_slots"], slots_total=slots,
            spec_draft_tokens=t.spec_draft_tokens, spec_accepted_tokens=t.spec_accepted_tokens,
            spec_accept_rate=t.spec_accepted_tokens / t.spec_draft_tokens if t.spec_draft_tokens else 0.0,
            # The chance that a draft stands once those before it stood (the per-draft rate MTP papers quote).
            spec_accept_per_draft=(t.spec_accepted_tokens / (t.spec_accepted_tokens + t.spec_rejections)
                                   if t.spec_draft_tokens else 0.0),
            prompt_tokens=counts["prompt_tokens"], prefix_cache_hit_tokens=counts["prefix_cache_hit_tokens"],
            prefix_cache_pages=counts["prefix_cache_pages"], prefix_cache_idle_pages=counts["prefix_cache_idle_pages"],
            prefix_cache_snapshots=counts["prefix_cache_snapshots"], **self.warmup.status())

    def clear_prefix_cache(self) -> int:
        """Free every cached page that no running request holds (and its snapshot); returns how many."""
        return self.scheduler.clear_prefix_cache()

    def compile_remaining(self) -> None:
        """Compile the buckets not compiled yet, on this thread (warm-up mode "covering")."""
        self.warmup.compile_remaining()

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until every bucket is compiled (True) or `timeout` seconds passed (False). Serving never needs
        this; benchmarks of steady state do."""
        return self.warmup.wait(timeout)

    def close(self) -> None:
        """Stop compiling in the background (after the programs compiling now)."""
        self.warmup.stop()

    def reset_metrics(self) -> None:
        self.times = StepTimes()
