"""What the kernel benchmark scripts share: one report (printed, and written to a log file when one is open), a
timing helper, and sections that keep going when one of them fails (a broken section must not cost the rest of a
device run). Imported by the scripts in this folder, which run as `python3 bench/<script>.py`."""

import functools
import time
import traceback

import jax
import numpy as np

ROWS: list[str] = []  # result lines, printed again as a summary at the end
_log = None


def open_log(path: str | None) -> None:
    global _log
    _log = open(path, "w") if path else None


def say(*parts) -> None:
    line = " ".join(str(x) for x in parts)
    print(line, flush=True)
    if _log:
        _log.write(line + "\n")
        _log.flush()


def timeit(f, *args, target_s=0.3):
    """Median seconds per call of an already-jitted f (compiled on the first call, not timed)."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    one = time.perf_counter() - t0
    n = int(min(max(target_s / max(one, 1e-6), 1), 200))
    rounds = []
    for _ in range(5 if one < 0.2 else 2):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / n)
    return float(np.median(rounds))


# An op of tens of µs timed call by call measures the host's dispatch of a jitted call, about 40 µs on the H200
# (2026-12-01: every DeepSeek decode linear 40-60 µs that way, bf16 too, against 7-57 µs in one executable). Such rows
# run the op over several operand sets in one executable, distinct enough together (IN_GRAPH_BYTES) to overflow the
# H200's 50 MB L2 as a step's layers do, and report the time per op.
IN_GRAPH_BYTES = 256 << 20
DISPATCH_BOUND_S = 50e-6  # a call whose floor is under this is timed in one graph


def in_one_graph(op):
    """f(shared, per_call) runs op(*shared, *per_call[i]) for every i in one executable (time it with `timeit`
    and divide by len(per_call))."""
    return jax.jit(lambda shared, per_call: [op(*shared, *a) for a in per_call])


def copies_for(nbytes: int, cap: int = 64) -> int:
    """How many operand sets of `nbytes` each fill IN_GRAPH_BYTES (2 to `cap`)."""
    return int(min(max(IN_GRAPH_BYTES // max(nbytes, 1), 2), cap))


def section(fn):
    @functools.wraps(fn)
    def run(*a, **k):
        say(f"--- {fn.__name__}")
        try:
            fn(*a, **k)
        except Exception:  # keep going: one broken section must not cost the rest of the device run
            say(traceback.format_exc())
            ROWS.append(f"{fn.__name__}: FAILED")
    return run
