"""The serving loop: validate, schedule, run one executable, account for the sampled tokens; repeat."""

import logging
import random

from jaxmodels.engine.buckets import decode_buckets, prefill_buckets
from jaxmodels.engine.cache import PoolSizes, free_device_memory, pages_within
from jaxmodels.engine.family import step_for
from jaxmodels.engine.request import Request, SamplingParams, prompt_problems
from jaxmodels.engine.runner import Runner
from jaxmodels.engine.scheduler import Scheduler

log = logging.getLogger("jaxmodels.engine")


class InvalidRequest(ValueError):
    """A request rejected before it reached the device; the message names what is wrong."""


class Engine:
    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, max_prefill_tokens: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, warmup: bool = True, progress: bool = True,
                 prefill_sizes: list[int] | None = None, decode_sizes: list[int] | None = None, mesh=None,
                 memory_fraction: float | None = None):
        """`prefill_sizes` / `decode_sizes` replace the default bucket lists (fewer buckets compile faster; the
        largest prefill bucket is the per-step token budget, the largest decode one must be max_batch_size).

        Pages: `num_pages` if given; else, with `memory_fraction`, as many as fit in that fraction of the device
        memory still free after the weights (the rest is left for activations and compilation); else enough for
        max_batch_size requests of max_seq_len tokens.
        """
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        self.config = model.config
        self.max_seq_len = max_seq_len
        prefill_sizes = sorted(prefill_sizes or prefill_buckets(max_prefill_tokens or min(max_seq_len, 1024)))
        decode_sizes = sorted(decode_sizes or decode_buckets(max_batch_size))
        if decode_sizes[-1] != max_batch_size:
            raise ValueError(f"the largest decode bucket must be max_batch_size={max_batch_size}: {decode_sizes}")
        max_prefill_tokens = prefill_sizes[-1]
        step = step_for(model)
        self.sizes = PoolSizes.from_limits(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                           page_size=page_size, num_pages=num_pages)
        if num_pages is None and memory_fraction is not None:
            if not 0 < memory_fraction < 1:
                raise ValueError(f"memory_fraction must be in (0, 1), got {memory_fraction}")
            devices = list(mesh.devices.flat) if mesh is not None else None
            # Sized as if every cache were whole on each device: safe, if low, where KV pages split over tp.
            budget = int(memory_fraction * free_device_memory(devices))
            pages = pages_within(budget, step.cache_shapes, self.sizes)
            self.sizes = PoolSizes.from_limits(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                               page_size=page_size, num_pages=pages)
        log.info("engine limits: max_batch_size=%d max_seq_len=%d max_prefill_tokens=%d; pools: %d KV pages of %d "
                 "tokens (page 0 null), %d state slots (slot 0 null)", max_batch_size, max_seq_len,
                 max_prefill_tokens, self.sizes.num_pages, page_size, self.sizes.num_slots)
        self.scheduler = Scheduler(self.sizes, max_batch_size=max_batch_size, max_prefill_tokens=max_prefill_tokens,
                                   max_seq_len=max_seq_len)
        self.runner = Runner(step, self.sizes, decode_sizes=decode_sizes,
                             prefill_sizes=prefill_sizes, max_seqs_per_extend=max_batch_size, mesh=mesh)
        if warmup:
            self.runner.warmup(progress)
        self.eos_ids = frozenset(self.config.eos_token_id)
        self._next_id = 0
        self._seeds = random.Random(0)

    def add_request(self, prompt, params: SamplingParams) -> Request:
        """Queue a request; raises InvalidRequest (touching no state) when the prompt or its params are bad."""
        prompt = [int(t) if hasattr(t, "__index__") else t for t in prompt]
        problems = prompt_problems(prompt, vocab_size=self.config.vocab_size, max_seq_len=self.max_seq_len)
        problems += params.problems()
        if problems:
            raise InvalidRequest("; ".join(problems))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        request = Request(self._next_id, prompt, params, seed, eos_ids=self.eos_ids)
        self._next_id += 1
        self.scheduler.add(request)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one step; returns the requests that received a token in it."""
        kind, work = self.scheduler.schedule()
        if kind == "extend":
            return self.scheduler.finish_extend(work, self.runner.run_extend(work))
        return self.scheduler.finish_decode(work, self.runner.run_decode(work))
