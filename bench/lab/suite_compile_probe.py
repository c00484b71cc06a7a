"""Where the test suite's time goes: per test, its wall time and JAX's own compile-phase durations.

A pytest plugin (jax.monitoring's duration events: tracing, lowering to MLIR, XLA's backend compile, and the
persistent cache's savings), written as JSON lines under $SUITE_PROBE_DIR (default /tmp/suite_probe), one file per
xdist worker; then a summary of the run by file. Tests run in subprocesses (the sharded checks, the CLI) show their
wall time only. From the repository root:

    SUITE_PROBE_DIR=/tmp/suite_probe PYTHONPATH=bench/lab python -m pytest -x -q -n 2 -p suite_compile_probe
    python bench/lab/suite_compile_probe.py /tmp/suite_probe
"""

import collections
import glob
import json
import os
import sys
import time

BACKEND = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def summarise(directory: str, top: int = 40) -> None:
    rows = [json.loads(line) for path in glob.glob(os.path.join(directory, "tests-*.jsonl")) for line in open(path)]
    totals = collections.Counter()
    by_file = collections.defaultdict(collections.Counter)
    for row in rows:
        for counter in (totals, by_file[row["test"].split("::")[0]]):
            counter["wall"] += row["wall"]
            counter["compiles"] += row["counts"].get(BACKEND, 0)
            for name, event in (("backend", BACKEND), ("trace+lower", TRACE), ("trace+lower", LOWER),
                                ("saved", SAVED)):
                counter[name] += row["events"].get(event, 0.0)
    print(f"{len(rows)} tests: {totals['wall']:.0f} s of test time over the workers, backend compile "
          f"{totals['backend']:.0f} s, tracing and lowering {totals['trace+lower']:.0f} s, "
          f"{totals['compiles']} compilations, {totals['saved']:.0f} s saved by the persistent cache")
    print("\n| wall s | backend s | compilations | trace+lower s | file |\n|---|---|---|---|---|")
    for name, c in sorted(by_file.items(), key=lambda item: -item[1]["wall"])[:top]:
        print(f"| {c['wall']:.1f} | {c['backend']:.1f} | {c['compiles']} | {c['trace+lower']:.1f} | {name} |")


if __name__ == "__main__":
    summarise(sys.argv[1] if len(sys.argv) > 1 else "/tmp/suite_probe")
else:  # loaded by pytest with -p suite_compile_probe
    import jax.monitoring
    import pytest

    _events, _counts = collections.Counter(), collections.Counter()

    def _record(event: str, duration: float, **_) -> None:
        _events[event] += duration
        _counts[event] += 1

    jax.monitoring.register_event_duration_secs_listener(_record)
    _directory = os.environ.get("SUITE_PROBE_DIR", "/tmp/suite_probe")
    os.makedirs(_directory, exist_ok=True)
    _out = open(os.path.join(_directory, f"tests-{os.getpid()}.jsonl"), "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _events.clear()
        _counts.clear()
        start = time.perf_counter()
        yield
        _out.write(json.dumps({"test": item.nodeid, "wall": time.perf_counter() - start, "events": dict(_events),
                               "counts": dict(_counts)}) + "\n")
        _out.flush()
