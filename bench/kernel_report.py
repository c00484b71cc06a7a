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
