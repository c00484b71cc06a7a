"""What /metrics reports, in Prometheus' text format: the engine's gauges and counters and the server's own."""

import collections
import dataclasses


class ThroughputWindow:
    """Output tokens per second over the last `seconds` (tokens generated in the window / its length)."""

    def __init__(self, seconds: float = 10.0):
        self.seconds = seconds
        self.total = 0
        self._samples = collections.deque()  # (time, total after that step), oldest first
        self._before_window = 0  # the total at the newest sample already out of the window

    def add(self, now: float, tokens: int) -> None:
        self.total += tokens
        self._samples.append((now, self.total))
        self._forget(now)

    def rate(self, now: float) -> float:
        self._forget(now)
        return (self.total - self._before_window) / self.seconds

    def _forget(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.seconds:
            self._before_window = self._samples.popleft()[1]


@dataclasses.dataclass
class ServerStats:
    """The server's own counts, kept on the event loop thread."""

    pending: int = 0  # choices submitted and not finished (what the queue limit counts)
    prompt_tokens: int = 0
    finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by finish_reason
    rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by HTTP status


# (name, type, help, key in the engine's snapshot); spec_* keys appear only where speculation is on.
ENGINE_METRICS = [
    ("requests_running", "gauge", "Requests holding a batch slot.", "running"),
    ("requests_waiting", "gauge", "Requests queued in the engine for a slot.", "waiting"),
    ("generation_tokens_per_second", "gauge", "Output tokens per second over the last 10 s.", "tokens_per_s"),
    ("generation_tokens_total", "counter", "Output tokens generated.", "generated_tokens"),
    ("kv_pages_used", "gauge", "KV cache pages in use.", "kv_pages_used"),
    ("kv_pages_total", "gauge", "KV cache pages in the pool.", "kv_pages_total"),
    ("slots_used", "gauge", "Request state slots in use.", "slots_used"),
    ("slots_total", "gauge", "Request state slots in the pool.", "slots_total"),
    ("engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("preemptions_total", "counter", "Requests preempted for lack of pages.", "preemptions"),
    ("mean_decode_batch", "gauge", "Mean requests per decode step.", "mean_decode_batch"),
    ("wall_seconds_per_step", "gauge", "Mean wall time of an engine step.", "wall_s_per_step"),
    ("host_fraction", "gauge", "Fraction of step time spent on the host.", "host_fraction"),
    ("spec_draft_tokens_total", "counter", "Speculative draft tokens proposed.", "spec_draft_tokens"),
    ("spec_accepted_tokens_total", "counter", "Speculative draft tokens accepted.", "spec_accepted_tokens"),
    ("spec_accept_rate", "gauge", "Fraction of draft tokens accepted.", "spec_accept_rate"),
    ("ready_seconds", "gauge", "Seconds from the start (weights included) until the engine could serve.", "ready_s"),
    ("buckets_ready", "gauge", "Step-program buckets compiled and in use.", "buckets_ready"),
    ("buckets_compiling", "gauge", "Step-program buckets still compiling in the background.", "buckets_compiling"),
    ("prefix_cache_prompt_tokens_total", "counter",
     "Tokens that admitted requests needed in the caches (prompts, and outputs again after a preemption).",
     "prompt_tokens"),
    ("prefix_cache_hit_tokens_total", "counter", "Of those, tokens found in the prefix cache.",
     "prefix_cache_hit_tokens"),
    ("prefix_cache_pages", "gauge", "KV pages held by the prefix cache (some also by running requests).",
     "prefix_cache_pages"),
    ("prefix_cache_idle_pages", "gauge", "Prefix-cache pages no running request holds (the pool may take them).",
     "prefix_cache_idle_pages"),
    ("prefix_cache_snapshots", "gauge", "Recurrent-state snapshots held by the prefix cache.",
     "prefix_cache_snapshots"),
]


def prometheus_text(engine: dict, stats: ServerStats, prefix: str = "jaxmodels_") -> str:
    lines = []

    def family(name, kind, help_text, samples):
        lines.extend([f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}"])
        lines.extend(f"{prefix}{name}{labels} {float(value)!r}" for labels, value in samples)

    for name, kind, help_text, key in ENGINE_METRICS:
        if engine.get(key) is not None:
            family(name, kind, help_text, [("", engine[key])])
    kv_total = engine["kv_pages_total"]
    family("kv_cache_usage", "gauge", "Fraction of KV cache pages in use.",
           [("", engine["kv_pages_used"] / kv_total if kv_total else 0.0)])
    family("server_pending_requests", "gauge", "Choices accepted by the server and not finished.",
           [("", stats.pending)])
    family("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", stats.prompt_tokens)])
    family("requests_finished_total", "counter", "Choices finished, by finish_reason.",
           [(f'{{finish_reason="{reason}"}}', count) for reason, count in sorted(stats.finished.items())])
    family("requests_rejected_total", "counter", "Requests answered with an error, by HTTP status.",
           [(f'{{status="{status}"}}', count) for status, count in sorted(stats.rejected.items())])
    return "\n".join(lines) + "\n"
