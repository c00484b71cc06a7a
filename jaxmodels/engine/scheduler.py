"""Continuous batching on the host: which requests run in the next step, and what their tokens did to them.

Each step is either an extend (chunks of prompts, up to `max_prefill_tokens` tokens, packed) or a decode (one token
for every decoding request). Extends go first, so new requests join between decode steps. A request gets a Mamba
slot when admitted and KV pages as its tokens need them; admission and chunk sizes follow the free pages. When a
decode needs a page and none is free, the newest request is preempted: its slot and pages are freed, its output is
kept, and it is recomputed from its tokens later (so no request is dropped).
"""

import collections
import math

from jaxmodels.engine.cache import FreeList, PoolSizes
from jaxmodels.engine.request import Request


class Scheduler:
    def __init__(self, sizes: PoolSizes, *, max_batch_size: int, max_prefill_tokens: int, max_seq_len: int):
        self.sizes = sizes
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_seq_len = max_seq_len
        self.free_pages = FreeList(sizes.num_pages, "KV page")
        self.free_slots = FreeList(sizes.num_slots, "state slot")
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self):
        """("extend", [(request, start, length)]) or ("decode", [request]); never empty while work is left."""
        while True:
            chunks = self._extend_chunks()
            if chunks:
                return "extend", chunks
            batch = self._decode_batch()
            if batch:
                return "decode", batch
            # Only partial prefills hold the pool and none can grow: give back the newest one's pages.
            if not self.running:
                raise RuntimeError("scheduler stalled with nothing running; the pool is too small")
            self._preempt(self.running[-1])

    def _pages_for(self, request: Request, end: int) -> int:
        return max(0, math.ceil(end / self.sizes.page_size) - len(request.pages))

    def _extend_chunks(self):
        budget = self.max_prefill_tokens
        chunks = []
        candidates = [r for r in self.running if not r.decoding] + list(self.waiting)
        for request in candidates:
            if budget == 0 or len(chunks) == self.max_batch_size:
                break
            admitted = request.slot != 0
            if not admitted and not len(self.free_slots):
                break
            start = request.num_computed
            length = min(len(request.token_ids) - start, budget)
            # Shrink the chunk to the pages that are free; the rest waits for pages to come back.
            room = (len(request.pages) + len(self.free_pages)) * self.sizes.page_size - start
            length = min(length, room)
            if length <= 0:
                break
            if not admitted:
                self.waiting.remove(request)
                request.slot = self.free_slots.take()[0]
                self.running.append(request)
            request.pages += self.free_pages.take(self._pages_for(request, start + length))
            chunks.append((request, start, length))
            budget -= length
        return chunks

    def _decode_batch(self):
        batch = []
        for request in list(self.running):
            if not request.decoding or request not in self.running:
                continue
            while self._pages_for(request, request.num_computed + 1) > len(self.free_pages):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                request.pages += self.free_pages.take(self._pages_for(request, request.num_computed + 1))
                batch.append(request)
        # A request preempted after it joined the batch must not run.
        return [r for r in batch if r in self.running]

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed = 0
        request.decoding = False
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.running.remove(request)
        self.free_pages.give_back(request.pages)
        self.free_slots.give_back([request.slot])
        request.pages, request.slot = [], 0

    def finish_extend(self, chunks, sampled) -> list[Request]:
        """Account for an extend step; sampled[i] is the token drawn after chunk i. Returns requests that got a
        token."""
        got = []
        for (request, start, length), token in zip(chunks, sampled):
            request.num_computed = start + length
            if request.num_computed == len(request.token_ids):
                request.decoding = True
                self._append(request, int(token))
                got.append(request)
        return got

    def finish_decode(self, batch, sampled) -> list[Request]:
        for request, token in zip(batch, sampled):
            request.num_computed += 1
            self._append(request, int(token))
        return list(batch)

    def _append(self, request: Request, token: int) -> None:
        request.output.append(token)
        request.token_ids.append(token)
        reason = request.stop_reason(token, self.max_seq_len)
        if reason is not None:
            request.finish_reason = reason
            self._release(request)
