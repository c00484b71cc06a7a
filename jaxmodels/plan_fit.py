"""What fits on a device when a plan does not (jaxmodels.plan): the largest batch at the planned request length, the
longest requests at the planned batch, and the largest prefill bucket.

A device's cache bytes grow linearly in its pool's pages and state slots (jaxmodels.plan.cache_bytes_by_pool), so
a plan's per-page and per-slot bytes price any other limits, sized as the engine sizes its pools (PoolSizes and the
default prefix-caching snapshots). Weights, the other per-slot state and the programs' temporaries stay at the
planned ones (a smaller batch has somewhat smaller temporaries: the answer errs low).
"""

import math

from jaxmodels.engine.cache import PoolSizes
from jaxmodels.engine.engine import default_snapshots


def cache_bytes(plan, batch: int, seq_len: int) -> float:
    """A device's cache bytes for `batch` requests (all dp groups) of `seq_len` tokens."""
    planned = plan.pool_sizes
    page = planned.page_size
    # Speculative decoding's page-table rows reach past max_seq_len (engine.Engine): keep the planned margin.
    margin = planned.pages_per_seq - math.ceil(plan.limits["max_seq_len"] / page)
    group = batch // plan.dp
    sizes = PoolSizes.from_limits(max_batch_size=group, max_seq_len=(math.ceil(seq_len / page) + margin) * page,
                                  page_size=page,
                                  num_snapshots=default_snapshots(group) if planned.num_snapshots else 0)
    per_page = plan.cache_by_pool["page"] / planned.num_pages
    per_slot = plan.cache_by_pool["slot"] / planned.state_slots
    return per_page * sizes.num_pages + per_slot * sizes.state_slots


def cache_budget(plan, memory: float) -> float:
    """The bytes a device has for its pools beside the weights, the other state and the temporaries."""
    return memory - plan.weights - plan.state - plan.temporaries()


def _largest(fits, low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (fits is monotone: true up to some n), or None."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def largest_batch(plan, memory: float, seq_len: int, cap: int = 1 << 20) -> int | None:
    """The largest max_batch_size (a multiple of dp) whose pools of `seq_len`-token requests fit, or None."""
    budget = cache_budget(plan, memory)
    groups = _largest(lambda k: cache_bytes(plan, k * plan.dp, seq_len) <= budget, 1, cap // plan.dp)
    return None if groups is None else groups * plan.dp


def largest_seq_len(plan, memory: float, batch: int, cap: int) -> int | None:
    """The largest max_seq_len (a multiple of the page size, at most `cap`) whose pools for `batch` requests fit."""
    budget = cache_budget(plan, memory)
    page = plan.pool_sizes.page_size
    pages = _largest(lambda n: cache_bytes(plan, batch, n * page) <= budget, 1, cap // page)
    return None if pages is None else pages * page


def largest_prefill_bucket(plan, memory: float) -> int | None:
    """The largest prefill bucket (tokens per dp group) up to which every compiled prefill program fits beside the
    planned pools and the decode programs' temporaries, or None (only what was compiled is known)."""
    room = memory - plan.resident
    if plan.temporaries(extend=False) > room:
        return None
    forwards = [p for p in plan.programs if p.is_extend and p.job[0] != "sampler"]  # the samplers are small
    fitting = None
    for n in sorted({p.job[1] for p in forwards}):
        if any(p.transient_bytes > room for p in forwards if p.job[1] == n):
            break
        fitting = n
    return fitting
