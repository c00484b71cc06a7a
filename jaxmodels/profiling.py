"""Per-op time from a `jax.profiler` trace: where a step's device time goes.

    with jax.profiler.trace(directory, create_perfetto_trace=True):
        ...                          # the steps to look at
    print(format_op_table(op_table(directory), steps=n))
    print(format_occupancy(*device_occupancy(directory), steps=n))
    print(format_host_table(op_table(directory, HOST), steps=n))

The perfetto trace (`plugins/profile/<run>/perfetto_trace.json.gz`) holds complete events ("ph": "X") per process;
device work sits in processes named like "/device:GPU:0" (one thread per stream), host work in "/host:CPU". Events
are grouped by op name (XLA fusions, cuBLAS GEMMs, our Pallas kernels by their `name=`), summed, and tagged with a
coarse category so a table reads at a glance: which kernel or fusion dominates, and how far it is from its floor.
"""

import collections
import dataclasses
import glob
import gzip
import json
import os
import re

HOST = r"/host:"  # the process of the host threads' events (dispatch, thunk launches, the runtime's own work)

# First match wins; op names are matched case-insensitively.
CATEGORIES = (
    ("ssm scan", r"ssd_chunk_scan"),
    ("ssm state update", r"ssd_state_update"),
    ("conv1d", r"causal_conv1d"),
    ("attention", r"paged_attention|sparse_mla|flash|attention"),
    ("indexer", r"index_logits|select_topk"),
    ("moe gemm", r"grouped_matmul|ragged"),
    ("gemm", r"gemm|cublas|cutlass|xmma|nvjet|dot|matmul"),
    ("collective", r"nccl|all-gather|all_gather|reduce-scatter|reduce_scatter|all-reduce|all_reduce|collective"),
    ("copy", r"memcpy|memset|copy"),
    ("sort / top-k", r"sort|top_k|topk"),
    ("scatter / gather", r"scatter|gather"),
)


@dataclasses.dataclass
class OpTime:
    name: str
    category: str
    total_us: float
    count: int


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return category
    return "other fusion"


def find_trace(directory: str) -> str:
    """The newest perfetto trace under a `jax.profiler.trace` directory."""
    paths = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory} (trace with create_perfetto_trace=True)")
    return max(paths, key=os.path.getmtime)


def load_events(path: str) -> tuple[list[dict], dict[int, str]]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, processes


def _complete_events(directory: str, process_pattern: str):
    """The complete ("X") events of the processes whose name matches `process_pattern`."""
    events, processes = load_events(find_trace(directory))
    wanted = {pid for pid, name in processes.items() if re.search(process_pattern, name)}
    return [event for event in events if event.get("ph") == "X" and event.get("pid") in wanted]


def op_table(directory: str, process_pattern: str = r"/device:") -> list[OpTime]:
    """Ops of the processes whose name matches `process_pattern` (device streams by default), longest first."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in _complete_events(directory, process_pattern):
        entry = totals[event["name"]]
        entry[0] += float(event.get("dur", 0.0))
        entry[1] += 1
    ops = [OpTime(name, categorize(name), total, count) for name, (total, count) in totals.items()]
    return sorted(ops, key=lambda op: -op.total_us)


def device_occupancy(directory: str, process_pattern: str = r"/device:") -> tuple[float, float]:
    """(busy_us, span_us): the union of the device's kernel intervals, and the time from the first kernel's start to
    the last one's end. span - busy is time the device sat idle between kernels: the launch gaps inside a step's
    CUDA graph, and any wait for the host between steps (what the host's share of a step costs, when it costs)."""
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
                       for e in _complete_events(directory, process_pattern))
    if not intervals:
        return 0.0, 0.0
    busy, (start, end) = 0.0, intervals[0]
    for s, e in intervals[1:]:
        if s > end:  # a gap: close the busy run
            busy, start = busy + end - start, s
        end = max(end, e)  # the latest end so far
    return busy + end - start, end - intervals[0][0]


def format_occupancy(busy_us: float, span_us: float, *, steps: int = 1) -> str:
    idle = 1 - busy_us / span_us if span_us else 0.0
    return (f"device busy {busy_us / steps / 1e3:.3f} ms of {span_us / steps / 1e3:.3f} ms per step "
            f"(first kernel to last): idle {idle:.1%}")


def format_op_table(ops: list[OpTime], *, steps: int = 1, top: int = 20) -> str:
    """Markdown tables: per category, then the `top` ops; times per step (the trace covered `steps` steps)."""
    total = sum(op.total_us for op in ops) or 1.0
    by_category: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        by_category[op.category] += op.total_us
    kernels = sum(op.count for op in ops) / steps
    lines = [f"device time {total / steps / 1e3:.3f} ms per step over {steps} step(s), {kernels:.0f} kernels per step",
             "",
             "| category | ms / step | share |", "|---|---|---|"]
    for category, us in sorted(by_category.items(), key=lambda item: -item[1]):
        lines.append(f"| {category} | {us / steps / 1e3:.3f} | {us / total:.1%} |")
    lines += ["", "| op | category | calls / step | ms / step | share |", "|---|---|---|---|---|"]
    for op in ops[:top]:
        name = op.name if len(op.name) <= 60 else op.name[:57] + "..."
        lines.append(f"| `{name}` | {op.category} | {op.count / steps:.1f} | {op.total_us / steps / 1e3:.3f} | "
                     f"{op.total_us / total:.1%} |")
    return "\n".join(lines)


def format_host_table(ops: list[OpTime], *, steps: int = 1, top: int = 25) -> str:
    """Markdown table of the host threads' events, longest first, per step. Host events nest (a dispatch holds its
    executable's launch, which holds each kernel's), so the times are inclusive and do not add up."""
    lines = [f"host events per step over {steps} step(s), inclusive times", "",
             "| host event | calls / step | ms / step |", "|---|---|---|"]
    for op in ops[:top]:
        name = op.name if len(op.name) <= 70 else op.name[:67] + "..."
        lines.append(f"| `{name}` | {op.count / steps:.1f} | {op.total_us / steps / 1e3:.3f} |")
    return "\n".join(lines)
