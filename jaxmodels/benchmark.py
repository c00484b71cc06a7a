"""The serving benchmark: our engine on random weights made on the device, at a real model's shapes.

    python -m jaxmodels bench --config bench/configs/nemotron_h_nano9b.json [--compare-transformers]
    python -m jaxmodels bench --config bench/configs/deepseek_v32_4layer.json --phases prefill,decode --fp8-block
    python -m jaxmodels bench --workload multiturn --config ...   (conversations: jaxmodels/benchmark_multiturn.py)

Phases (`--phases`, all by default):
  * decode: for each concurrency B of `--batches`, B prompts of `--prompt-len` tokens submitted at once, then
    `--decode-steps` decode steps; the median wall time of the steady decode steps (every row a real request) is the
    step time (with overlapped scheduling and host time below it, that is the device's), beside the host time per
    step and the floor: the bytes the step must move (weights, active experts only, KV / state) at 4.25 TB/s.
  * prefill: for each length of `--prefill-len` (comma-separated), one prompt of that many tokens and one output
    token; time to the first token (median of three) against the FLOP floor at 810 TFLOP/s.
  * serve: `--serve` requests of `--serve-in` tokens in and `--serve-out` out, all at once and then with Poisson
    arrivals at `--arrival-rate` requests/s: output tok/s, TTFT and inter-token latency p50 / p90 / p99, host time
    per step.
`--fp8-block` serves the same random model with block-scaled FP8 weights, as DeepSeek-V3.2 publishes its checkpoint
(`FP8_BLOCK_QUANTIZATION`): the layers that format quantizes hold the dense random weights quantized on the device
(e4m3, one float32 scale per 128 x 128 block); the floors count the bytes held, one per FP8 weight, and the FLOPs
through FP8 weights at the FP8 rate (jaxmodels.benchmark_floors). The transformers comparator stays bf16.
Peak device memory is reported at the end. `--compare-transformers` first runs transformers' `generate` on the same
config (its own random weights) in a separate process (`jaxmodels.benchmark_transformers`), so the two never share
GPU memory, at the sizes it can hold. `--profile DIR` traces a few decode steps at the largest batch and one
prefill with `jax.profiler` and prints the per-op table (`jaxmodels.profiling`).

The JSON (`--json`) also records how it was made: the command, the commit, the device and the jax version. It is
written after the decode and prefill phases too, marked `cut_off_after` the last phase done, so that a run stopped
by a time limit keeps what it measured; the run's end rewrites it whole, without the mark.
`--plot DIR` draws its figures and `python -m jaxmodels bench-report` renders saved JSONs as figures and markdown
tables (jaxmodels.benchmark_report).

The last line is the headline.
"""

import argparse
import dataclasses
import functools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxmodels.benchmark_floors import decode_floor_s, model_costs, prefill_floor_s
from jaxmodels.benchmark_report import PERCENTILES, their_prefill_rows
from jaxmodels.engine.grammar import GrammarSpec
from jaxmodels.step_context import StepKind

# DeepSeek-V3.2's published quantization_config: e4m3 weights with one scale per 128 x 128 block, activations
# quantized per token and 128 channels with power-of-two scales.
FP8_BLOCK_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}


def cut_layers(raw: dict, layers: int | None) -> dict:
    """The config with only its first `layers` layers (all when None); comment keys dropped."""
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    if layers is None:
        return raw
    if raw["model_type"] == "nemotron_h":
        raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:layers]
        raw.pop("layers_block_type", None)
    raw["num_hidden_layers"] = layers
    return raw


PREFILL_REPEATS = 3  # timed prompts per prefill length, the median reported (ours and transformers')


def random_model(raw: dict, dtype: str, calibration_tokens: int = 512, center_head: bool = True):
    """Our model for `raw` with random weights, initialised directly on the default device, its MoE routing
    balanced (`balance_routing`) and, unless `center_head` is False, its LM head centered (`center_lm_head`). With
    a block-scaled FP8 `quantization_config` in `raw`, the layers it quantizes then hold their random weights in FP8
    (routed on the dense weights' balance, which FP8 rounding barely moves)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.families import load_config, model_class
    from jaxmodels.quantization import with_fp8_weights

    config = load_config(raw)

    def build():  # its own random keys each call: the check's abstract build draws none from the real one
        return model_class(config)(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))

    check_random_weights_fit(build, jax.devices()[0])
    model = build()
    hidden = balance_routing(model, np.random.default_rng(1).integers(3, config.vocab_size,
                                                                      size=(1, calibration_tokens)))
    if center_head:
        center_lm_head(model, hidden)
    return with_fp8_weights(model, config, quantize=True)


def check_random_weights_fit(build, device) -> None:
    """A clear error, before any weight is made, where the weights of the model `build()` makes exceed what JAX may
    use of `device`: random weights are made in the model dtype there (an FP8 model is quantized from them after), so
    a model too large would fail deep inside XLA (DeepSeek-V3.2's 4 layers: 74.0 GB of bf16 against the 64 GB JAX
    takes of an 80 GB H100). The weights alone: a model that passes can still run out in its first forward. Devices
    that report no memory limit (the CPU) are not checked."""
    from jaxmodels.engine.cache import total_bytes
    from jaxmodels.nnx_params import abstract_module

    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        return
    needed = total_bytes(abstract_module(build)[2])
    if needed > limit:
        raise SystemExit(f"the random weights of this config take {needed / 1e9:.1f} GB in the model dtype (an FP8 "
                         f"model is quantized from them), more than the {limit / 1e9:.1f} GB JAX may use on "
                         f"{device.device_kind}: keep fewer layers (--layers N), or give JAX more of the GPU "
                         "(XLA_PYTHON_CLIENT_MEM_FRACTION)")


def balance_routing(model, calibration_ids):
    """Balance each MoE router on its inputs from a forward over `calibration_ids` (`standardize_router`); returns
    that forward's final hidden states [1, T, H] (balanced), which `center_lm_head` reads.

    Random weights route badly: the relu² and SiLU layers add a vector shared by all tokens to the residual stream,
    so deep layers send every token to the same experts (measured on the Nano-30B shape in bf16: 39 of 128 experts
    used by 256 tokens at the fifth MoE layer), and an MoE benchmark would read a fraction of the expert weights a
    trained model reads. The calibration forward runs eagerly, layer by layer, so each layer sees the previous
    layers' balanced output; then each MTP layer drafts over it, so that its router is balanced on its own inputs.
    """
    from jaxmodels.layers.moe import MoE

    route = MoE.route

    def calibrating_route(self, x):
        standardize_router(self.gate, x)
        return route(self, x)

    MoE.route = calibrating_route
    try:
        hidden = model.hidden_states(calibration_ids)
        draft = hidden
        for depth in range(model.num_mtp_layers):  # each MTP layer on the hidden states it drafts from
            draft = model.mtp_step(draft[:, :-1], calibration_ids[:, depth + 1:], depth=depth)[1]
        return hidden
    finally:
        MoE.route = route


def standardize_router(gate, x) -> None:
    """Make every expert's routing score distributed alike over the router inputs x[..., H], as a balanced trained
    router's are: each expert's logit centered (the inputs' mean direction projected out of the router weights) and
    scaled to unit standard deviation, then `e_score_correction_bias` set to minus the expert's mean score.

    Trained DeepSeek-style routers keep their load balanced with that bias (adjusted during training,
    "auxiliary-loss-free" balancing), and the bias alone is its one-shot analogue only where the experts' scores
    spread alike. A random router's do not: its rows meet the inputs' few dominant directions at random angles, so
    some experts' logits vary several times more than others', and top-k picks those again and again. At the
    DeepSeek-V3.2 shape, the last tokens of 32 random prompts touched 124-125 experts per MoE layer with the bias
    alone and 160-170 standardized, where uniform routing touches 163.3 (CPU, experts cut to width 64;
    bench/lab/greedy_routing_probe.py).
    """
    import jax
    import jax.numpy as jnp

    tokens = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    weight = _without_direction(gate.weight[...].T, _mean_direction(tokens)).T  # [E, H] float32
    spread = jnp.matmul(tokens, weight.T, precision=jax.lax.Precision.HIGHEST).std(axis=0)
    gate.weight.set_value(weight / jnp.maximum(spread, jnp.finfo(jnp.float32).tiny)[:, None])
    scores = jax.nn.sigmoid(gate.logits(x))
    gate.e_score_correction_bias.set_value(-scores.mean(axis=0))


def center_lm_head(model, hidden) -> None:
    """Project out of the LM head the direction that `hidden` (final hidden states [..., H]) share on average.

    The vector the random layers add to every token (see `balance_routing`) survives to the final norm and
    outweighs each token's own part, so the head scores the same few tokens first for every request: greedy decoding
    of 32 random prompts at the Nano-30B shape gave 2 distinct next tokens (32 with the head centered; H200, full
    width, bench/lab/greedy_routing_probe.py), and a decode batch whose requests all feed the same token reads fewer
    experts than real traffic does (MoE rows above 100% of the floor, which assumes uniform routing). With the
    shared direction removed, each request's greedy tokens follow its own state, as a trained model's do. The head
    keeps its shape and dtype, so the step's cost is unchanged. Tied embeddings are left as they are: the head is
    the input embedding there, and changing it would change every layer's input.
    """
    if model.config.tie_word_embeddings:
        return
    kernel = model.lm_head.kernel  # [H, V]
    kernel.set_value(_without_direction(kernel[...], _mean_direction(hidden)))


def _mean_direction(x):
    """The unit vector along the mean of x[..., H] over all its leading axes, in float32."""
    import jax.numpy as jnp

    mean = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1]).mean(axis=0)
    return mean / jnp.linalg.norm(mean)


def _without_direction(kernel, unit):
    """kernel[H, V] less its component along the unit vector unit[H], in kernel's dtype; computed in float32 (not
    the GPU's default TF32) in one compiled program, so that the outer product and the difference are fused rather
    than held (the DeepSeek head is 129,280 x 7,168: 3.7 GB an array in float32)."""
    return _compiled_projection()(kernel, unit)


@functools.cache
def _compiled_projection():
    """`_without_direction`'s program, jitted once per process (so once per shape: every router of a model
    shares one)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def project(kernel, unit):
        weights = kernel.astype(jnp.float32)
        along = jnp.matmul(unit, weights, precision=jax.lax.Precision.HIGHEST)
        return (weights - jnp.outer(unit, along)).astype(kernel.dtype)

    return project


def percentile_ms(values, q) -> float:
    return float(np.percentile(values, q) * 1e3) if len(values) else float("nan")


def latency_percentiles(arrived: dict, token_times: dict) -> dict:
    """TTFT and inter-token latency percentiles in ms (`ttft_p50_ms`, ..., `itl_p99_ms`) from each request's
    arrival and the times its tokens came (seconds, by request id). An ITL is the gap between two consecutive
    tokens of one request: gaps are never taken across requests, and a request's first token counts only in TTFT."""
    ttft = [times[0] - arrived[key] for key, times in token_times.items() if times]
    itl = np.concatenate([np.diff(times) for times in token_times.values()] + [np.zeros(0)])
    out = {}
    for name, values in (("ttft", ttft), ("itl", itl)):
        out.update({f"{name}_p{q}_ms": percentile_ms(values, q) for q in PERCENTILES})
    return out


@dataclasses.dataclass
class StepLog:
    """Per-step wall and host seconds of an engine loop, with what each step sent to the device."""

    wall: list = dataclasses.field(default_factory=list)
    host: list = dataclasses.field(default_factory=list)
    launch: list = dataclasses.field(default_factory=list)

    def record(self, engine, start: float, wait_before: float) -> None:
        wall = time.perf_counter() - start
        self.wall.append(wall)
        self.host.append(wall - (engine.times.wait_s - wait_before))
        self.launch.append(engine.last_launch)

    def steady_decode(self, batch: int) -> list[int]:
        """The steps that sent a decode of `batch` rows right after another: steady decoding, every row real."""
        step = (StepKind.DECODE, batch)
        return [i for i in range(1, len(self.launch)) if self.launch[i] == step and self.launch[i - 1] == step]


def run_engine(engine, arrivals, on_arrival=None, on_token=None, progress=None) -> StepLog:
    """Step the engine until `arrivals` ([(time offset s, prompt, params)], sorted) are all served;
    `on_arrival(request, time)` and `on_token(request, time)` see each request join and get each token."""
    log = StepLog()
    start = time.perf_counter()
    pending = list(arrivals)[::-1]
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[-1][0] <= now:
            offset, prompt, params = pending.pop()
            request = engine.add_request(prompt, params)
            if on_arrival is not None:
                on_arrival(request, start + offset)
        if not engine.has_work():
            time.sleep(max(0.0, pending[-1][0] - now))
            continue
        step_start, wait_before = time.perf_counter(), engine.times.wait_s
        updated = engine.step()
        log.record(engine, step_start, wait_before)
        if on_token is not None:
            now = time.perf_counter()
            for request in updated:
                on_token(request, now)
        if progress is not None:
            progress.update(len(updated))
    return log


# A JSON schema of the kind agents ask for (records of typed fields), with more required items than a decode phase
# draws tokens: no request completes it and leaves the batch early.
BENCH_SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "email", "tags", "active"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                   "email": {"type": "string"}, "active": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}}

# The decode phase's request kinds (`--sampling`), all greedy: plain, with logprobs, with every penalty, under a
# JSON schema (its masks computed on the host each step, which needs a tokenizer: --tokenizer). The adjusting
# sampler serves all but the first (engine.sampler.sample_adjusted).
SAMPLING_VARIANTS = {"plain": {}, "logprobs": dict(logprobs=5),
                     "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
                     "json": dict(structured_output=GrammarSpec.json_schema(BENCH_SCHEMA))}


def eos_of_tokenizer(path: str) -> int:
    """The id of `</s>` in a tokenizer.json: the EOS of a shapes-only config (bench/configs name none), which
    structured output's grammars end with."""
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(path).token_to_id("</s>")
    if eos is None:
        raise SystemExit(f"the config names no eos_token_id and {path} has no </s> token to take as EOS")
    return eos


def decode_phase(llm, costs, batch: int, prompt_len: int, steps: int, vocab: int, rng, sampling: str = "plain"
                 ) -> dict:
    from jaxmodels import SamplingParams

    prompts = rng.integers(3, vocab, size=(batch, prompt_len)).tolist()
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True, **SAMPLING_VARIANTS[sampling])
    log = run_engine(llm.engine, [(0.0, p, params) for p in prompts])
    steady = log.steady_decode(batch)
    step_s = float(np.median([log.wall[i] for i in steady]))
    host_s = float(np.median([log.host[i] for i in steady]))
    floor = decode_floor_s(costs, batch, prompt_len + steps / 2)
    return dict(batch=batch, sampling=sampling, step_ms=step_s * 1e3, tok_s=batch / step_s, host_ms=host_s * 1e3,
                host_share=host_s / step_s, floor_ms=floor * 1e3, floor_tok_s=batch / floor, of_floor=floor / step_s)


def prefill_phase(llm, costs, length: int, vocab: int, rng, repeats: int = PREFILL_REPEATS) -> dict:
    from jaxmodels import SamplingParams

    times = []
    for _ in range(repeats):
        prompt = rng.integers(3, vocab, size=length).tolist()
        start = time.perf_counter()
        run_engine(llm.engine, [(0.0, prompt, SamplingParams(max_new_tokens=1, temperature=0.0))])
        times.append(time.perf_counter() - start)
    ttft = float(np.median(times))
    floor = prefill_floor_s(costs, length)
    return dict(tokens=length, ttft_ms=ttft * 1e3, tok_s=length / ttft, floor_ms=floor * 1e3, of_floor=floor / ttft)


def serve_phase(llm, n: int, len_in: int, len_out: int, rate: float, vocab: int, rng, progress: bool) -> dict:
    """N requests, all at once (rate 0) or Poisson arrivals at `rate`/s; latency percentiles over requests."""
    from tqdm.auto import tqdm

    from jaxmodels import SamplingParams

    params = SamplingParams(max_new_tokens=len_out, temperature=0.0, ignore_eos=True)
    offsets = np.cumsum(rng.exponential(1 / rate, size=n)) if rate > 0 else np.zeros(n)
    arrivals = [(float(t), rng.integers(3, vocab, size=len_in).tolist(), params) for t in offsets]
    arrived, token_times = {}, {}

    def on_arrival(request, at):
        arrived[request.request_id], token_times[request.request_id] = at, []

    def on_token(request, at):
        token_times[request.request_id].append(at)

    llm.engine.reset_metrics()
    start = time.perf_counter()
    with tqdm(total=n * len_out, desc=f"serve {n} x {len_in}/{len_out}", disable=not progress, unit="tok") as bar:
        run_engine(llm.engine, arrivals, on_arrival, on_token, bar)
    elapsed = time.perf_counter() - start
    metrics = llm.metrics()
    return dict(requests=n, rate=rate, in_tokens=len_in, out_tokens=len_out, seconds=elapsed,
                out_tok_s=n * len_out / elapsed, **latency_percentiles(arrived, token_times),
                host_ms_per_step=metrics["host_s_per_step"] * 1e3, host_share=metrics["host_fraction"],
                preemptions=metrics["preemptions"])


def run_transformers(config_path: str, args) -> dict:
    """The comparator in its own process (torch and JAX never share the GPU's memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "transformers.json")
        command = [sys.executable, "-m", "jaxmodels.benchmark_transformers", "--config", config_path,
                   "--batches", ",".join(map(str, args.batches)), "--prompt-len", str(args.prompt_len),
                   "--decode-steps", str(args.decode_steps), "--prefill-len", ",".join(map(str, args.prefill_len)),
                   "--dtype", args.dtype, "--device", args.torch_device, "--json", out]
        if args.layers:
            command += ["--layers", str(args.layers)]
        subprocess.run(command, check=True)
        with open(out) as f:
            return json.load(f)


def traced(path: str, run) -> None:
    """run() (which waits for the device's work itself) under a jax.profiler trace."""
    import jax

    jax.profiler.start_trace(path, create_perfetto_trace=True)
    try:
        run()
    finally:
        jax.profiler.stop_trace()


def profile_decode(llm, batch: int, prompt_len: int, steps: int, vocab: int, rng, path: str) -> None:
    """Trace `steps` steady decode steps of `batch` requests (their prompts' extend steps stay out of it); verify
    steps with speculative decoding."""
    from jaxmodels import SamplingParams

    engine = llm.engine
    steady = (StepKind.VERIFY if engine.num_speculative_tokens else StepKind.DECODE, batch)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for prompt in rng.integers(3, vocab, size=(batch, prompt_len)).tolist():
        engine.add_request(prompt, params)
    launches = []
    while launches[-2:] != [steady] * 2:
        engine.step()
        launches.append(engine.last_launch)

    def decode_steps():
        for _ in range(steps):
            engine.step()
        engine.runner.block_until_ready()

    traced(path, decode_steps)
    while engine.has_work():
        engine.step()


FIRST_DEVICE = r"/device:\w+:0\b"  # on a mesh every device runs the same program: tables show the first one's


def profile_phases(llm, args, phases, vocab, rng, directory: str) -> None:
    """Per-op tables of the measured phases: decode at the sweep's smallest and largest batch, and the prefill
    prompt (the engine is sized for the phases asked for, so a phase not measured is not profiled either)."""
    from jaxmodels import SamplingParams
    from jaxmodels.profiling import (
        HOST, device_occupancy, format_host_table, format_occupancy, format_op_table, op_table)

    steps = 8
    if "decode" in phases:
        for batch in sorted({min(args.batches), max(args.batches)}):
            path = os.path.join(directory, f"decode_b{batch}")
            profile_decode(llm, batch, args.prompt_len, steps, vocab, rng, path)
            print(f"\n## profile: decode B={batch}, {steps} steady steps")
            print(format_op_table(op_table(path, FIRST_DEVICE), steps=steps))
            print(format_occupancy(*device_occupancy(path, FIRST_DEVICE), steps=steps))
            print(format_host_table(op_table(path, HOST), steps=steps, top=60))
    if "prefill" not in phases:
        return
    path = os.path.join(directory, "prefill")
    length = max(args.prefill_len)
    prompt = rng.integers(3, vocab, size=length).tolist()
    traced(path, lambda: run_engine(llm.engine, [(0.0, prompt, SamplingParams(max_new_tokens=1, temperature=0.0))]))
    print(f"\n## profile: prefill of one {length}-token prompt")
    print(format_op_table(op_table(path, FIRST_DEVICE), steps=1))


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table: columns are (header, key, format)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[k], f) if isinstance(row.get(k), (int, float)) else str(row.get(k, "-"))
                 for _, k, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COMMIT_ENV = "JAXMODELS_COMMIT"


def source_commit() -> str:
    """$JAXMODELS_COMMIT when set (a copy of the tree on a GPU machine may carry a stale .git: the device tool's
    copy reported its first session's commit, "-dirty", for code two commits later); else the short hash of the
    commit this code was checked out at, with "-dirty" when tracked files differ from it; else "unknown"."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    package = os.path.dirname(os.path.abspath(__file__))

    def git(*command):
        return subprocess.run(["git", *command], cwd=package, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):  # no git installed, or a hung one
        pass
    return "unknown"


def provenance(argv: list[str], prog: str | None) -> dict:
    """What a reader of the results needs to reproduce them: the command (as this benchmark was called, so a
    run from a script or test records the options it got), the commit and the UTC date."""
    return {"command": shlex.join([*(prog or "python -m jaxmodels.benchmark").split(), *argv]),
            "commit": source_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def default_label(args) -> str:
    label = os.path.splitext(os.path.basename(args.config))[0]
    if args.layers:
        label += f" ({args.layers} layers)"
    return label + (" fp8-block" if args.fp8_block else "")


def parse_args(argv, prog):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="an HF config.json (real shapes: bench/configs/)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--phases", default="decode,prefill,serve")
    parser.add_argument("--batches", default="1,32,128,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--sampling", default="plain", type=lambda s: s.split(","),
                        help=f"the decode phase's requests, comma-separated, each at every batch size: "
                        f"{', '.join(SAMPLING_VARIANTS)} (greedy, logprobs=5, presence/frequency 0.5 and repetition "
                        "1.1, a JSON schema: BENCH_SCHEMA, needs --tokenizer)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json for the random model (structured output "
                        "compiles its grammars for it; its vocabulary at most the config's)")
    parser.add_argument("--prefill-len", default="4096", type=lambda s: [int(x) for x in s.split(",")],
                        help="prompt lengths of the prefill phase, comma-separated: TTFT and tok/s for each")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per extend step")
    parser.add_argument("--serve", type=int, default=256, help="requests in the serving run")
    parser.add_argument("--serve-in", type=int, default=1024)
    parser.add_argument("--serve-out", type=int, default=1024)
    parser.add_argument("--arrival-rate", type=float, default=8.0, help="Poisson arrivals per second (0: skip)")
    parser.add_argument("--mamba-ssm-cache-dtype", default=None)
    parser.add_argument("--fp8-block", action="store_true",
                        help="serve the model with block-scaled FP8 weights (DeepSeek-V3.2's format)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel groups (each its own requests)")
    parser.add_argument("--tp", type=int, default=1, help="devices per group splitting attention heads")
    parser.add_argument("--no-overlap", action="store_true", help="read each step's tokens before the next")
    parser.add_argument("--no-launch-thread", dest="launch_thread", action="store_false",
                        help="launch each step from the scheduling thread, not from a thread of its own (engine.runner;"
                        " with the launch thread, the host time reported is the scheduling thread's)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="serve without prefix caching (engine.prefix_cache), e.g. to price it where prompts "
                        "share nothing")
    parser.add_argument("--compilation-cache", default=None, metavar="DIR",
                        help="load the compiled step programs from DIR when there, store them there when not; 'off': "
                        "no cache (default: jaxmodels.compilation_cache's, ~/.cache/jaxmodels/xla)")
    parser.add_argument("--compare-transformers", action="store_true")
    parser.add_argument("--torch-device", default="cuda")
    parser.add_argument("--profile", default=None, help="directory for jax.profiler traces")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, metavar="DIR",
                        help="draw the results' figures into DIR as PNGs (needs matplotlib: the [bench] extra)")
    parser.add_argument("--label", default=None,
                        help="the name of this run in figures and tables (default: the config's file name)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def engine_limits(args, phases) -> dict:
    """One engine for every phase: decode buckets are the sweep's sizes and powers of two (for the serving run's
    shrinking batches), per dp group (a batch of B rows is B / dp rows in each group), prefill buckets a small and
    a full chunk (per group too)."""
    max_batch = max([*args.batches, args.serve if "serve" in phases else 1])
    sizes = {b for b in args.batches if b <= max_batch} | {max_batch}
    size = 1
    while size < max_batch and "serve" in phases:
        sizes.add(size)
        size *= 2
    lengths = [args.prompt_len + args.decode_steps + 2]
    if "prefill" in phases:
        lengths.append(max(args.prefill_len) + 1)
    if "serve" in phases:
        lengths.append(args.serve_in + args.serve_out)
    if max_batch % args.dp:
        raise SystemExit(f"the largest batch ({max_batch}) must be a multiple of --dp {args.dp}")
    return dict(max_batch_size=max_batch, max_seq_len=max(lengths) + 1,
                decode_sizes=sorted({-(-b // args.dp) for b in sizes}),
                prefill_sizes=sorted({min(256, args.prefill_chunk), args.prefill_chunk}))


def main(argv=None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "multiturn" in [a.split("=")[-1] for a in argv if a.startswith("--workload")] + \
            [b for a, b in zip(argv, argv[1:]) if a == "--workload"]:
        from jaxmodels.benchmark_multiturn import main as multiturn

        return multiturn(argv, prog)
    args = parse_args(argv, prog)
    phases = set(args.phases.split(","))
    if set(args.sampling) - set(SAMPLING_VARIANTS):
        raise SystemExit(f"--sampling takes {', '.join(SAMPLING_VARIANTS)}; got {','.join(args.sampling)}")
    if "json" in args.sampling and args.tokenizer is None:
        raise SystemExit("--sampling json needs --tokenizer (structured output compiles its grammar for one)")
    with open(args.config) as f:
        raw = cut_layers(json.load(f), args.layers)
    if args.fp8_block:
        raw["quantization_config"] = FP8_BLOCK_QUANTIZATION
    if args.tokenizer is not None and not raw.get("eos_token_id"):
        raw["eos_token_id"] = eos_of_tokenizer(args.tokenizer)
    weights = "fp8-block" if args.fp8_block else args.dtype
    results = {"label": args.label or default_label(args), **provenance(argv, prog), "config": args.config,
               "layers": args.layers or "all", "dtype": args.dtype, "weights": weights,
               "prefix_caching": not args.no_prefix_caching}
    if args.compare_transformers:  # first: its process must be gone before JAX takes the GPU
        results["transformers"] = run_transformers(args.config, args)

    import jax

    import jaxmodels
    from jaxmodels.nnx_params import model_params

    model = random_model(raw, args.dtype)
    costs = model_costs(model.config, model_params(model), args.dtype, args.mamba_ssm_cache_dtype)
    start = time.perf_counter()
    llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, overlap=not args.no_overlap, dp=args.dp, tp=args.tp,
                        launch_thread=args.launch_thread, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                        enable_prefix_caching=not args.no_prefix_caching, tokenizer=args.tokenizer,
                        progress=not args.no_progress, compilation_cache_dir=args.compilation_cache,
                        **engine_limits(args, phases))
    del model  # on a mesh the engine holds the sharded copy; the one-device weights must not stay beside it
    results["ready_s"] = time.perf_counter() - start
    llm.wait_until_compiled()  # the phases measure steady state: every bucket ready
    results["compile_s"] = time.perf_counter() - start
    vocab = raw["vocab_size"]
    rng = np.random.default_rng(0)
    run_engine(llm.engine, [(0.0, [5] * 8, jaxmodels.SamplingParams(max_new_tokens=4, temperature=0.0))])
    device = jax.devices()[0]
    results.update(device=device.device_kind, device_count=jax.device_count(), jax_version=jax.__version__)
    print(f"\nmodel {raw['model_type']} ({args.layers or 'all'} layers, "
          f"{costs.dense_weight_bytes / 1e9 + costs.moe_layers * costs.num_experts * costs.expert_bytes / 1e9:.1f} GB "
          f"of {weights} weights, {args.dtype} activations) on {device.device_kind}; ready in "
          f"{results['ready_s']:.1f} s, every bucket compiled in {results['compile_s']:.1f} s")

    on_mesh = args.dp * args.tp > 1
    if "decode" in phases:
        results["decode"] = [decode_phase(llm, costs, b, args.prompt_len, args.decode_steps, vocab, rng, sampling)
                             for b in args.batches for sampling in args.sampling]
        without_floors_on_a_mesh(results["decode"], on_mesh, "floor_ms", "floor_tok_s", "of_floor")
        write_partial(args.json, results, "decode")
    if "prefill" in phases:
        results["prefill_sweep"] = [prefill_phase(llm, costs, length, vocab, rng) for length in args.prefill_len]
        without_floors_on_a_mesh(results["prefill_sweep"], on_mesh, "floor_ms", "of_floor")
        # The longest prompt's row under the key readers of a single length know.
        results["prefill"] = max(results["prefill_sweep"], key=lambda row: row["tokens"])
        write_partial(args.json, results, "prefill")
    if "serve" in phases:
        results["serve"] = [serve_phase(llm, args.serve, args.serve_in, args.serve_out, rate, vocab, rng,
                                        not args.no_progress)
                            for rate in ([0.0, args.arrival_rate] if args.arrival_rate else [0.0])]
    stats = device.memory_stats() or {}
    # The peak includes building the random model (a dense copy and float32 temporaries before FP8 quantization);
    # what serving holds (weights, pools, the compiled programs' buffers) is what is in use after the phases.
    results["peak_memory_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    results["memory_in_use_gb"] = stats.get("bytes_in_use", 0) / 1e9
    report(results)
    if args.json:  # before profiling: a long profile must not cost the measurements
        write_json(args.json, results)
    if args.plot:
        from jaxmodels.benchmark_report import plot_results

        for path in plot_results([results], args.plot):
            print(f"figure: {path}")
    if args.profile:
        profile_phases(llm, args, phases, vocab, rng, args.profile)


def without_floors_on_a_mesh(rows: list[dict], on_mesh: bool, *keys: str) -> None:
    """The floors count one device's traffic; a mesh splits it unevenly (experts over every device, attention, Mamba
    and their caches over the dp groups), so no one-device floor applies there: '-'."""
    if on_mesh:
        for row in rows:
            row.update(dict.fromkeys(keys, "-"))


def write_json(path: str, results: dict) -> None:
    """`results` to `path`, whole or not at all (a run killed while writing leaves the last complete file)."""
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)


def write_partial(path: str | None, results: dict, phase: str) -> None:
    """What is measured so far, marked with the last phase done (`cut_off_after`): a run stopped by a time limit
    keeps it. The run's end writes the whole results without the mark."""
    if path:
        write_json(path, {**results, "cut_off_after": phase})


def report(results: dict) -> None:
    theirs = results.get("transformers", {})
    if "decode" in results:
        their_decode = {row["batch"]: row for row in theirs.get("decode", [])}
        for row in results["decode"]:
            theirs_row = their_decode.get(row["batch"], {})
            row["transformers_tok_s"] = theirs_row.get("tok_s", theirs_row.get("error", "-"))
        print("\n### decode (steady steps, all rows real)")
        print(table(results["decode"], [("B", "batch", "d"), ("sampling", "sampling", ""),
                                        ("ms / step", "step_ms", ".2f"),
                                        ("tok/s", "tok_s", ",.0f"), ("host ms / step", "host_ms", ".2f"),
                                        ("host share", "host_share", ".1%"), ("floor ms", "floor_ms", ".2f"),
                                        ("% of floor", "of_floor", ".0%"),
                                        ("transformers tok/s", "transformers_tok_s", ",.0f")]))
    if "prefill" in results:
        rows = results["prefill_sweep"]
        their_prefill = {row["tokens"]: row for row in their_prefill_rows(results)}
        for row in rows:
            theirs_row = their_prefill.get(row["tokens"], {})
            row["transformers_ttft_ms"] = theirs_row.get("ttft_ms", theirs_row.get("error", "-"))
            row["transformers_tok_s"] = theirs_row.get("tok_s", theirs_row.get("error", "-"))
        print("\n### prefill (one prompt, time to first token)")
        print(table(rows, [("tokens", "tokens", "d"), ("TTFT ms", "ttft_ms", ".1f"), ("tok/s", "tok_s", ",.0f"),
                           ("floor ms", "floor_ms", ".1f"), ("% of floor", "of_floor", ".0%"),
                           ("transformers TTFT ms", "transformers_ttft_ms", ".1f"),
                           ("transformers tok/s", "transformers_tok_s", ",.0f")]))
    if "serve" in results:
        print("\n### serving run")
        print(table(results["serve"], [("requests", "requests", "d"), ("arrivals/s", "rate", ".1f"),
                                       ("seconds", "seconds", ".1f"), ("output tok/s", "out_tok_s", ",.0f"),
                                       ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p90 ms", "ttft_p90_ms", ".0f"),
                                       ("TTFT p99 ms", "ttft_p99_ms", ".0f"), ("ITL p50 ms", "itl_p50_ms", ".1f"),
                                       ("ITL p90 ms", "itl_p90_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
                                       ("host ms / step", "host_ms_per_step", ".2f"),
                                       ("host share", "host_share", ".1%"), ("preemptions", "preemptions", "d")]))
    print(f"\npeak device memory {results['peak_memory_gb']:.1f} GB (model building included); in use after the "
          f"phases {results['memory_in_use_gb']:.1f} GB")
    print("headline: " + headline(results))


def headline(results: dict) -> str:
    parts = []
    if "decode" in results:
        best = max(results["decode"], key=lambda r: (r["batch"], r["sampling"] == "plain"))
        parts.append(f"decode B={best['batch']} {best['tok_s']:,.0f} tok/s ({best['step_ms']:.2f} ms/step, host "
                     f"{best['host_share']:.0%})")
    if "prefill" in results:
        parts.append(f"prefill {results['prefill']['tok_s']:,.0f} tok/s")
    if "serve" in results:
        parts.append(f"serving {results['serve'][0]['out_tok_s']:,.0f} output tok/s")
    return "; ".join(parts)


if __name__ == "__main__":
    main()
