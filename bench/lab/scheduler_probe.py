"""Host cost of the Python around a decode step, without a device: the scheduler's schedule(), the decode batch
builder and the token accounting for B decoding requests, per step.

    PYTHONPATH=. python3 bench/lab/scheduler_probe.py [--batch 256] [--steps 300]
"""

import argparse
import time

from jaxmodels.engine.batch import decode_batch
from jaxmodels.engine.cache import PoolSizes
from jaxmodels.engine.request import Request, SamplingParams
from jaxmodels.engine.scheduler import Scheduler
from jaxmodels.step_context import StepKind


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    sizes = PoolSizes.from_limits(max_batch_size=args.batch, max_seq_len=2048)
    scheduler = Scheduler(sizes, max_batch_size=args.batch, max_prefill_tokens=4096, max_seq_len=2048)
    params = SamplingParams(max_new_tokens=1500, temperature=0.0)
    for i in range(args.batch):
        scheduler.add(Request(i, list(range(3, 67)), params, 0, eos_ids=frozenset([2])))
    while (work := scheduler.schedule())[0] is StepKind.EXTEND:  # prefill every prompt first
        scheduler.finish_extend(work[1], [5] * len(work[1]))
    scheduler.finish_decode(work[1], [7] * len(work[1]))
    totals = dict(schedule=0.0, batch=0.0, finish=0.0)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        _, requests = scheduler.schedule()
        t1 = time.perf_counter()
        decode_batch(requests, args.batch, scheduler.slots)
        t2 = time.perf_counter()
        scheduler.finish_decode(requests, [7] * len(requests))
        t3 = time.perf_counter()
        totals["schedule"] += t1 - t0
        totals["batch"] += t2 - t1
        totals["finish"] += t3 - t2
    per_step = {name: seconds / args.steps * 1e3 for name, seconds in totals.items()}
    print(f"B={args.batch}: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in per_step.items())
          + f"; total {sum(per_step.values()):.3f} ms per step")


if __name__ == "__main__":
    main()
