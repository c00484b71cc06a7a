"""Continuous batching on the host: which requests run in the next step, and what their tokens did to them.

Each step is either an extend (chunks of prompts, up to `max_prefill_tokens` tokens, packed) or a decode (one token
for every decoding request). Extends go first, so new requests join between decode steps. A request gets a Mamba
slot when admitted and KV pages as its tokens need them; admission and chunk sizes follow the free pages. When a
decode needs a page and none is free, the newest request is preempted: its slot and pages are freed, its output is
kept, and it is recomputed from its tokens later (so no request is dropped).

`schedule()` commits what it returns: the chosen tokens count as computed from then on, so the engine may schedule
the next step before the device has returned this one's tokens (overlapped scheduling). The tokens come back
through `finish_extend` / `finish_decode`, which apply the stop conditions. A finished request may thus sit in one
more step than it needed; its extra token is dropped. Preempting needs every token on the host (the request is
recomputed from them), so `schedule(can_preempt=False)` returns None instead of preempting, and the engine settles
the step in flight first.

With speculative decoding (`num_speculative_tokens` k > 0) a decode step is a VERIFY step: each request's last
token and k drafts are checked at once and 1 to k+1 tokens come back (`finish_verify`). How many is known only then,
so num_computed moves when they come back; the device keeps each slot's position itself, and while a verify step is
in flight the next one is scheduled for the most it could have accepted (its pages, its length limit).

With prefix caching (engine.prefix_cache) a request is admitted with the longest cached prefix of its tokens: the
cached pages go into its page table, shared, and its first chunk starts after them (restoring a hybrid's recurrent
state from the prefix's snapshot on the way). Each full page a chunk computes is cached as it is scheduled, so that
requests arriving meanwhile share it; pages that decoding filled are cached when the request ends, and the rest of
what it computed as a tail (its partial page and a hybrid's state, which stays in the request's slot, kept aside in
`keeping`, until a new request needs the slot and the extend step that admits it stashes the state in a snapshot
slot). A hybrid's chunks end at the page edges where a snapshot is due (`_snapshot_points`), and the chunk's step
saves it. Cached pages that no request holds count as free: the pool takes them back, least recently used first,
when it needs them.

Host work per step is O(1) per request: requests are kept in dicts by id (admission order), and the per-slot tables
the batches are gathered from (`SlotTables`) are updated only when a request is admitted or gets a page.
"""

import collections
import math
from typing import NamedTuple

import numpy as np

from jaxmodels.engine.cache import FreeList, PoolSizes
from jaxmodels.engine.prefix_cache import PrefixCache
from jaxmodels.engine.request import BIAS_ENTRIES, Request, RequestStatus
from jaxmodels.step_context import StepKind


class Chunk(NamedTuple):
    """The tokens start .. start + length - 1 of a request, computed in one extend step. `restore`: the slot whose
    recurrent state the request's slot takes before the step (its cached prefix's snapshot); `save`: the snapshot
    slot that takes the slot's state after it (0: none); `stash`: (slot, snapshot slot), an ended request's state
    moved out of the slot this request takes, before the step."""

    request: Request
    start: int
    length: int
    restore: int = 0
    save: int = 0
    stash: tuple | None = None


class SlotTables:
    """Per-slot rows the step batches are gathered from: each slot's page-table row and its request's sampling
    parameters and prompt length. Slot 0 (the null slot of padding rows) keeps zeros: page 0, greedy."""

    def __init__(self, num_slots: int, pages_per_seq: int):
        self.page_table = np.zeros((num_slots, pages_per_seq), np.int32)
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_p = np.ones(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.seed = np.zeros(num_slots, np.uint32)
        self.prompt_len = np.zeros(num_slots, np.int32)
        # What the adjusting sampler reads (engine.sampler.adjust_logits): penalties, min_tokens, and a row of
        # (token, bias) entries, those of min_tokens' stop tokens flagged.
        self.adjusted = np.zeros(num_slots, bool)
        self.presence = np.zeros(num_slots, np.float32)
        self.frequency = np.zeros(num_slots, np.float32)
        self.repetition = np.ones(num_slots, np.float32)
        self.min_tokens = np.zeros(num_slots, np.int32)
        self.bias_ids = np.zeros((num_slots, BIAS_ENTRIES), np.int32)
        self.bias = np.zeros((num_slots, BIAS_ENTRIES), np.float32)
        self.bias_stops = np.zeros((num_slots, BIAS_ENTRIES), bool)

    def admit(self, request: Request) -> None:
        slot, p = request.slot, request.params
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, max(p.top_k, 0)
        self.seed[slot], self.prompt_len[slot] = request.seed, len(request.prompt)
        self.adjusted[slot] = p.adjusted
        if p.adjusted:
            self.presence[slot], self.frequency[slot] = p.presence_penalty, p.frequency_penalty
            self.repetition[slot], self.min_tokens[slot] = p.repetition_penalty, p.min_tokens
            entries = [(token, bias, False) for token, bias in (p.logit_bias or {}).items()]
            entries += [(token, -np.inf, True) for token in request.stop_tokens] if p.min_tokens else []
            for i, (token, bias, stop) in enumerate(entries):
                self.bias_ids[slot, i], self.bias[slot, i], self.bias_stops[slot, i] = token, bias, stop

    def add_pages(self, request: Request, pages: list[int]) -> None:
        start = len(request.pages)
        self.page_table[request.slot, start: start + len(pages)] = pages
        request.pages += pages

    def clear(self, slot: int) -> None:
        self.page_table[slot] = 0
        self.temperature[slot], self.top_p[slot], self.top_k[slot], self.seed[slot] = 0.0, 1.0, 0, 0
        self.prompt_len[slot] = 0
        if self.adjusted[slot]:
            self.adjusted[slot] = False
            self.presence[slot] = self.frequency[slot] = self.min_tokens[slot] = 0
            self.repetition[slot] = 1
            self.bias_ids[slot], self.bias[slot], self.bias_stops[slot] = 0, 0, False


class Scheduler:
    def __init__(self, sizes: PoolSizes, *, max_batch_size: int, max_prefill_tokens: int, max_seq_len: int,
                 num_speculative_tokens: int = 0, prefix_caching: bool = False, recurrent: bool = False,
                 state_copies: int = 0):
        """`prefix_caching`: keep and share computed pages (engine.prefix_cache); `recurrent`: the model keeps
        per-slot recurrent state, which then resumes only from snapshots (`sizes.num_snapshots` slots after the
        request slots), at most `state_copies` restores and as many saves per extend step."""
        self.sizes = sizes
        self.num_speculative_tokens = num_speculative_tokens
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_seq_len = max_seq_len
        self.free_pages = FreeList(sizes.num_pages, "KV page")
        self.free_slots = FreeList(sizes.num_slots, "state slot")
        # With prefix caching of a hybrid: slots of ended requests whose state a tail (engine.prefix_cache) still
        # needs, oldest first; free for new requests once that state is stashed.
        self.keeping: collections.OrderedDict[int, object] = collections.OrderedDict()
        self.slots = SlotTables(sizes.num_slots, sizes.pages_per_seq)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # by request id, in admission order: the last is preempted first
        self.num_preemptions = 0
        self.num_generated = 0  # tokens appended to requests' outputs
        self.blocked = False  # the last schedule() returned None because it needed a preemption it was not allowed
        self.cache = None
        if prefix_caching:
            snapshots = list(range(sizes.num_slots, sizes.state_slots)) if recurrent else None
            self.cache = PrefixCache(sizes.page_size, snapshots)
        self.state_copies = state_copies
        self.prompt_tokens = 0  # cumulative tokens that admissions had to have in the caches (hits included)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, can_preempt: bool = True):
        """(StepKind.EXTEND, [Chunk]) or (StepKind.DECODE, [Request]); None when nothing can run now (every
        running request waits for tokens in flight) or, with can_preempt=False, when running would need a
        preemption (then `blocked` is set)."""
        self.blocked = False
        while True:
            chunks = self._extend_chunks()
            if chunks:
                return StepKind.EXTEND, chunks
            batch = self._decode_batch(can_preempt)
            if batch is None:
                self.blocked = True
                return None
            if batch:
                return (StepKind.VERIFY if self.num_speculative_tokens else StepKind.DECODE), batch
            if not any(r.status is RequestStatus.PREFILLING for r in self.running.values()):
                return None  # only decoding requests that are finishing: their tokens are in flight
            # Only partial prefills hold the pool and none can grow: give back the newest one's pages.
            if not can_preempt:
                self.blocked = True
                return None
            self._preempt(self._newest())

    def _newest(self) -> Request:
        return self.running[next(reversed(self.running))]

    def _pages_for(self, request: Request, end: int) -> int:
        return max(0, math.ceil(end / self.sizes.page_size) - len(request.pages))

    def _free_count(self, holding: list = ()) -> int:
        """Pages a request can get now: the free ones and the cached ones no request holds, but for `holding`
        (cached pages and a tail about to be taken)."""
        idle = self.cache.idle_pages - sum(1 for node in holding if getattr(node, "refs", 0) == 0) if self.cache else 0
        return len(self.free_pages) + idle

    @staticmethod
    def _match_pages(match) -> list:
        """The cache's pages a match hands its request: the tree path's, then the tail's if it has one."""
        return match.pages + ([match.tail] if match.tail is not None and match.tail.page is not None else [])

    def _take_pages(self, n: int) -> list[int]:
        """n free pages, taking idle cached pages back (least recently used first) when too few are free."""
        if n > len(self.free_pages) and self.cache is not None:
            self.free_pages.give_back(self.cache.evict(n - len(self.free_pages)))
        return self.free_pages.take(n)

    def prefix_match(self, request: Request):
        """The longest cached prefix `request` can resume after; at least its last token is computed (its logits
        give the next one). Nothing for a penalized request: the device counts its tokens as its chunks pass."""
        limit = 0 if request.params.penalized else len(request.token_ids) - 1
        return self.cache.match(request.token_ids, limit)

    def _free_slot_count(self) -> int:
        return len(self.free_slots) + len(self.keeping)

    def _extend_chunks(self):
        budget = self.max_prefill_tokens
        chunks = []
        copies = 0  # state copies before the step: restores and stashes
        stashed = {}  # snapshot slot -> the slot its state moves from before this step (it is still there)
        prefilling = [r for r in self.running.values() if r.status is RequestStatus.PREFILLING]
        for request in prefilling + list(self.waiting):
            if budget == 0 or len(chunks) == self.max_batch_size:
                break
            admitted = request.status is RequestStatus.PREFILLING
            if not admitted and not self._free_slot_count():
                break
            match = self.prefix_match(request) if not admitted and self.cache is not None else None
            if match is not None and copies + self._copies_to_admit(match) > self.state_copies:
                break  # this step copies as many states as it can; the request waits for the next
            start = match.tokens if match else request.num_computed
            holding = self._match_pages(match) if match else ()
            held = len(holding) if match else len(request.pages)
            length = min(len(request.token_ids) - start, budget)
            # Shrink the chunk to the pages that are free; the rest waits for pages to come back.
            room = (held + self._free_count(holding)) * self.sizes.page_size - start
            length = min(length, room)
            if length <= 0:
                break
            restore, stash = 0, None
            if not admitted:
                restore, stash = self._admit(self.waiting.popleft(), match, stashed)
                copies += (restore > 0) + (stash is not None)
            point = next((p for p in request.snapshot_points if p > start), None)
            if point is not None and start + length > point:
                length = point - start  # the chunk ends where a snapshot is due
            self.slots.add_pages(request, self._take_pages(self._pages_for(request, start + length)))
            budget -= length
            request.num_computed = start + length
            chunks.append(Chunk(request, start, length, restore, stash=stash))
            if request.num_computed == len(request.token_ids):
                request.status = RequestStatus.DECODING  # this chunk's sampled token is its next output
        if self.cache is not None:
            # Only now: no request of this step may match what this step computes (its restores run before the step,
            # and a page's keys would be read by the step that writes them).
            saves = 0
            for i, chunk in enumerate(chunks):
                chunks[i] = self._cache_chunk(chunk, may_save=saves < self.state_copies)
                saves += chunks[i].save > 0
        return chunks

    def _cache_chunk(self, chunk: Chunk, may_save: bool) -> Chunk:
        """Cache the pages `chunk` fills, and save a snapshot where one is due, if the step `may_save` one more
        (a due snapshot not saved is skipped)."""
        request, end = chunk.request, chunk.start + chunk.length
        self._cache_pages(request, end)
        if end not in request.snapshot_points:
            return chunk
        request.snapshot_points.remove(end)
        node = request.cached[end // self.sizes.page_size - 1]
        slot = self.cache.snapshot_slot(node) if may_save else None
        if slot:
            self.cache.supersede(node)
        return chunk._replace(save=slot or 0)

    def _slot_source(self, match) -> str:
        """Where a request with `match` gets its slot: "tail" (its tail's, which holds the state it resumes from),
        "free", or "kept" (the slot kept longest for a tail, whose state is then stashed)."""
        if match is not None and match.tail is not None and match.tail.slot is not None:
            return "tail"
        return "free" if len(self.free_slots) else "kept"

    def _copies_to_admit(self, match) -> int:
        """State copies before the step that admitting a request with `match` needs: its restore, and the stash of
        the state kept in the slot it would take (see `_take_slot`)."""
        stash = (self._slot_source(match) == "kept" and not next(iter(self.keeping.values())).dropped
                 and self.state_copies > 0)
        return (match.snapshot is not None) + stash

    def _take_slot(self, match, stashed: dict) -> tuple[int, tuple | None]:
        """A slot for a request with `match` (see `_slot_source`); a kept slot's state is stashed in a snapshot
        slot (before the step: recorded in `stashed`) or, with no snapshot slot to take, dropped. -> (slot,
        (slot, snapshot slot) or None)."""
        source = self._slot_source(match)
        if source == "tail":
            del self.keeping[match.tail.slot]
            return match.tail.slot, None
        if source == "free":
            return self.free_slots.take()[0], None
        slot, kept = self.keeping.popitem(last=False)
        if kept.dropped:
            return slot, None
        snapshot = self.cache.stash(kept)
        if snapshot is None:
            return slot, None
        stashed[snapshot] = slot
        return slot, (slot, snapshot)

    def _admit(self, request: Request, match=None, stashed: dict | None = None) -> tuple[int, tuple | None]:
        """Admit `request` after `match` (its cached prefix) -> (the slot its state is restored from, 0 for none;
        the stash its slot needs, see `_take_slot`)."""
        restore = 0
        if match is not None and match.snapshot is not None:
            # Read before the step's copies write anything: the snapshot's state, even if this admission's stash
            # takes its slot; from the slot it is stashed from if an earlier admission of this step stashed it.
            restore = stashed.get(match.snapshot, match.snapshot)
        request.slot, stash = self._take_slot(match, stashed)
        request.status = RequestStatus.PREFILLING
        self.running[request.request_id] = request
        self.slots.admit(request)
        if self.cache is None:
            return restore, stash
        self.prompt_tokens += len(request.token_ids)
        self.cache.hit_tokens += match.tokens
        self.cache.hold(match.pages)
        request.cached = list(match.pages)
        self.slots.add_pages(request, [page.page for page in self._match_pages(match)])
        if match.tail is not None:
            self.cache.take_tail(match.tail)  # its page is the request's own now
        request.num_computed = match.tokens
        request.snapshot_points = self._snapshot_points(request, match) if self.cache.recurrent else []
        return restore, stash

    def _snapshot_points(self, request: Request, match) -> list[int]:
        """Where a hybrid's state is saved as its prompt is computed (see engine.prefix_cache): the page edge
        where it parts from a cached path (when no snapshot is there yet), and the last page edge before its last
        token."""
        size = self.sizes.page_size
        points = {(len(request.token_ids) - 1) // size * size}
        if match.parts and match.shared > len(match.pages):
            points.add(match.shared * size)
        return sorted(p for p in points if p > match.tokens)

    def _cache_pages(self, request: Request, end: int) -> None:
        """Cache the request's pages that are full of known tokens below `end` (computed, or being computed by
        steps sent before any step that reads them) and not cached yet."""
        size = self.sizes.page_size
        for i in range(len(request.cached), min(end, len(request.token_ids)) // size):
            parent = request.cached[-1] if request.cached else None
            node, _ = self.cache.insert(parent, tuple(request.token_ids[i * size: (i + 1) * size]), request.pages[i])
            request.cached.append(node)

    def _decode_batch(self, can_preempt: bool):
        if self.num_speculative_tokens:
            return self._verify_batch(can_preempt)
        # The hot loop of a large batch: plain attribute arithmetic, no helper calls unless a page is due.
        batch = []
        page_size, max_seq_len, decoding = self.sizes.page_size, self.max_seq_len, RequestStatus.DECODING
        preemptions = self.num_preemptions
        for request in list(self.running.values()):
            if request.status is not decoding:  # (a request preempted in this loop is waiting again)
                continue
            if not request.may_grow(max_seq_len):
                continue  # its last tokens are in flight; it finishes when they come back
            if request.num_computed // page_size >= len(request.pages):  # the new token opens a page
                grown = self._grow(request, 1, can_preempt)
                if grown is None:
                    return None
                if grown:
                    batch.append(request)
            else:
                batch.append(request)
        if self.num_preemptions != preemptions:  # a request preempted after it joined the batch must not run
            batch = [r for r in batch if r.request_id in self.running]
        for request in batch:
            request.num_computed += 1
        return batch

    def _verify_batch(self, can_preempt: bool):
        """The decoding requests of a VERIFY step, each with pages for every position the step may write: the
        target and the MTP layer write L .. L+k (L: the last token's position), the draft chain up to L+2k-1, and L
        is num_computed plus up to k+1 for each verify step still in flight."""
        batch = []
        k = self.num_speculative_tokens
        row_end = self.sizes.pages_per_seq * self.sizes.page_size
        for request in list(self.running.values()):
            if request.status is not RequestStatus.DECODING or not request.may_grow(self.max_seq_len):
                continue
            end = min(request.num_computed + (k + 1) * request.verifying + 2 * k, row_end)
            grown = self._grow(request, self._pages_for(request, end), can_preempt)
            if grown is None:
                return None
            if grown:
                batch.append(request)
        batch = [r for r in batch if r.request_id in self.running]
        for request in batch:
            request.verifying += 1
        return batch

    def _grow(self, request: Request, pages: int, can_preempt: bool) -> bool | None:
        """Give `request` `pages` more pages, preempting the newest requests while too few are free: True when it
        got them, False when it was preempted itself, None when that needed a preemption `can_preempt` forbids."""
        while pages > self._free_count():
            if not can_preempt:
                return None
            victim = self._newest()
            self._preempt(victim)
            if victim is request:
                return False
        self.slots.add_pages(request, self._take_pages(pages))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed = request.verifying = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        del self.running[request.request_id]
        pages, tail = request.pages, None
        if self.cache is not None:
            # Pages decoding filled join the cache too, and so does the rest as a tail (the next turn of a
            # conversation starts with them, and a preempted request resumes there); what the cache holds stays
            # there, the request's own pages (and its copies of cached ones) are freed.
            self._cache_pages(request, request.num_computed)
            tail = self._leave_tail(request)
            cached = request.cached
            pages = [page for i, page in enumerate(pages)
                     if (i >= len(cached) or cached[i].page != page) and (tail is None or page != tail.page)]
            self.cache.release(cached)
            request.cached, request.snapshot_points = [], []
        self.free_pages.give_back(pages)
        if tail is not None and tail.slot is not None:
            self.keeping[request.slot] = tail
        else:
            self.free_slots.give_back([request.slot])
        self.slots.clear(request.slot)
        request.pages, request.slot = [], 0

    def _leave_tail(self, request: Request):
        """The tail (engine.prefix_cache.CachedTail) of what `request` computed, kept in the cache; None where
        it would serve nothing or its state is not known: with speculative decoding the device may have accepted
        tokens the host has not seen."""
        n, size = request.num_computed, self.sizes.page_size
        if self.num_speculative_tokens or n == 0 or n > len(request.token_ids) or len(request.cached) != n // size:
            return None
        tokens = tuple(request.token_ids[n // size * size: n])
        parent = request.cached[-1] if request.cached else None
        if not tokens and (not self.cache.recurrent or parent.snapshot is not None):
            return None  # on a page edge, where an attention-only model resumes anyway, or a snapshot is already
        return self.cache.add_tail(parent, tokens, request.pages[n // size] if tokens else None,
                                   request.slot if self.cache.recurrent else None)

    def clear_prefix_cache(self) -> int:
        """Free the cached pages no running request holds (and their snapshots); returns how many."""
        if self.cache is None:
            return 0
        pages = self.cache.clear()
        self.free_pages.give_back(pages)
        self.free_slots.give_back(list(self.keeping))  # their tails are gone
        self.keeping.clear()
        return len(pages)

    def abort(self, request: Request) -> bool:
        """Finish `request` now with reason "abort", freeing whatever it holds; False if it already finished."""
        if request.finished:
            return False
        if request.request_id in self.running:
            self._release(request)
        else:
            self.waiting.remove(request)  # O(queue), but only on an abort
        self._finish(request, "abort")
        return True

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.status = RequestStatus.FINISHED

    def finish_extend(self, chunks, sampled) -> list[Request]:
        """Account for an extend step's tokens; sampled[i] (a python int) is the token drawn after chunk i. Returns
        the requests that got a token (those whose chunk completed their prompt)."""
        got = []
        for chunk, token in zip(chunks, sampled):
            request = chunk.request
            if chunk.start + chunk.length == len(request.token_ids) and not request.finished:
                self._append(request, token)
                got.append(request)
        return got

    def finish_decode(self, batch, sampled) -> list[Request]:
        """Account for a decode step's tokens (python ints, one per request of the batch); returns the requests that
        got one."""
        got = []
        finished = RequestStatus.FINISHED
        for request, token in zip(batch, sampled):
            if request.status is not finished:  # a token past a stop that was still in flight is dropped
                self._append(request, token)
                got.append(request)
        return got

    def finish_verify(self, batch, results) -> list[Request]:
        """Account for a VERIFY step: results[i] = the k+1 tokens and the number of drafts accepted, a, of request
        i; its first a+1 tokens are its new ones (fewer if it stops among them). Returns the requests that got some.
        """
        got = []
        for request, result in zip(batch, results):
            request.verifying -= 1
            if request.status is RequestStatus.FINISHED:
                continue
            accepted = result[-1]
            request.num_computed += accepted + 1
            for token in result[: accepted + 1]:
                self._append(request, token)
                if request.finished:
                    break
            got.append(request)
        return got

    def _append(self, request: Request, token: int) -> None:
        self.num_generated += 1
        request.output.append(token)
        request.token_ids.append(token)
        reason = request.stop_reason(token, self.max_seq_len)
        if reason is not None:
            self._release(request)
            self._finish(request, reason)


class GroupedScheduler:
    """One `Scheduler` per data-parallel group, stepping together.

    Each group has its own requests, state slots and KV pages (the engine's pools are split over the `dp` mesh
    axis); a request joins the group with the fewest requests and stays there. One device step serves every group
    with the same executable, so a step has one kind for all groups: `schedule` returns one step per kind that some
    group scheduled (an extend step with the decoding groups idle, then a decode step with the prefilling groups
    idle), each as a list of per-group work with [] for an idle group. With one group this is the plain scheduler.
    """

    def __init__(self, sizes: PoolSizes, dp: int, **limits):
        self.groups = [Scheduler(sizes, **limits) for _ in range(dp)]
        self._group_of: dict[int, int] = {}  # request id -> group

    def add(self, request: Request) -> None:
        """Queue `request` in the group with the fewest requests or, with prefix caching, in the group whose cache
        holds most of its tokens among the groups whose load is within a quarter batch of the least loaded."""
        loads = [group.load() for group in self.groups]
        candidates = range(len(self.groups))
        if len(self.groups) > 1 and self.groups[0].cache is not None:
            slack = max(1, self.groups[0].max_batch_size // 4)
            candidates = [g for g in candidates if loads[g] <= min(loads) + slack]
            hits = {g: self.groups[g].prefix_match(request).tokens for g in candidates}
            candidates = [g for g in candidates if hits[g] == max(hits.values())]
        group = min(candidates, key=lambda g: loads[g])
        self._group_of[request.request_id] = group
        self.groups[group].add(request)

    def clear_prefix_cache(self) -> int:
        return sum(group.clear_prefix_cache() for group in self.groups)

    def has_work(self) -> bool:
        return any(group.has_work() for group in self.groups)

    @property
    def num_preemptions(self) -> int:
        return sum(group.num_preemptions for group in self.groups)

    @property
    def num_generated(self) -> int:
        return sum(group.num_generated for group in self.groups)

    @property
    def blocked(self) -> bool:
        """Some group waits for a preemption, which needs every token in flight on the host first."""
        return any(group.blocked for group in self.groups)

    def schedule(self, can_preempt: bool = True) -> list[tuple[StepKind, list]]:
        steps: dict[StepKind, list] = {}
        for g, group in enumerate(self.groups):
            work = group.schedule(can_preempt)
            if work is not None:
                kind, items = work
                steps.setdefault(kind, [[] for _ in self.groups])[g] = items
        return [(kind, steps[kind]) for kind in StepKind if kind in steps]

    def finish(self, kind: StepKind, works: list, sampled: list) -> list[Request]:
        """Account for a step's tokens: sampled[g] (python ints) are group g's, in its work's order."""
        got = []
        finish = {StepKind.EXTEND: Scheduler.finish_extend, StepKind.DECODE: Scheduler.finish_decode,
                  StepKind.VERIFY: Scheduler.finish_verify}[kind]
        for group, work, tokens in zip(self.groups, works, sampled):
            got += finish(group, work, tokens)
        for request in got:
            if request.finished:
                del self._group_of[request.request_id]
        return got

    def abort(self, request: Request) -> bool:
        group = self._group_of.pop(request.request_id, None)
        return group is not None and self.groups[group].abort(request)

    def tables(self) -> list[SlotTables]:
        return [group.slots for group in self.groups]

    def counts(self) -> dict:
        """Requests and pool use summed over the groups."""
        groups = self.groups
        caches = [g.cache for g in groups if g.cache is not None]
        return dict(running=sum(len(g.running) for g in groups), waiting=sum(len(g.waiting) for g in groups),
                    free_pages=sum(g._free_count() for g in groups),
                    free_slots=sum(g._free_slot_count() for g in groups),
                    prompt_tokens=sum(g.prompt_tokens for g in groups),
                    prefix_cache_hit_tokens=sum(c.hit_tokens for c in caches),
                    prefix_cache_pages=sum(len(c) for c in caches),
                    prefix_cache_idle_pages=sum(c.idle_pages for c in caches),
                    prefix_cache_snapshots=sum(c.snapshots for c in caches))
