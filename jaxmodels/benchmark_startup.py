"""Start-up benchmark: how long a new user waits, and what the bucket lists cost.

    python -m jaxmodels.benchmark_startup start --config bench/configs/nemotron_h_nano30b_a3b.json
    python -m jaxmodels.benchmark_startup padding --config bench/configs/nemotron_h_nano9b.json
    python -m jaxmodels.benchmark_startup load --config bench/configs/nemotron_h_nano9b.json --checkpoint DIR
    python -m jaxmodels.benchmark_startup lowering --config bench/configs/nemotron_h_nano30b_a3b.json

`start`: as a new user would, with default options: random weights of the real shapes made on the device (the
clock starts before them), then `LLM(None, model=..., dtype, max_batch_size=256, max_seq_len=2008)` with nothing
else set; the time until the constructor returns (ready: the largest buckets compiled), until a first request (one
prompt of `--first-in` tokens, `--first-out` out) is served, then the serving run of `--serve` x (`--serve-in`,
`--serve-out`) at once while the other buckets compile in the background, the time that background compilation
took, and the same serving run again with every bucket ready. Run it twice with the same `--compilation-cache DIR`
for a cold and a warm start (the second in a new process).

`padding`: the cost of a coarser bucket list. An engine with every size of `--decode-sizes` and `--prefill-sizes`
compiled times the steady decode step at each batch size (all rows real) and the time to first token of one prompt
of each length; for each candidate list (the default, the engine's old SGLang-like list, and geometric ones), the
mean and worst extra time of padding a batch of n up to its bucket, over n = 1 .. the largest size (the step time
between measured sizes interpolated linearly), beside the number of buckets (what a start or a background
compilation pays for).

`load`: a real-size safetensors checkpoint of random weights written to `--checkpoint DIR` (once), then read with
`load_model` (the page cache dropped first when the process may do so): seconds and GB/s.

`lowering`: the largest decode and prefill programs lowered under cProfile, then compiled: where a bucket's seconds go.
"""

import argparse
import json
import os
import subprocess
import time

import numpy as np

from jaxmodels.benchmark import cut_layers, decode_phase, prefill_phase, random_model, run_engine, serve_phase, table


def _block(model) -> None:
    import jax
    from flax import nnx

    jax.block_until_ready(nnx.state(model))


def start_phase(args) -> dict:
    """The new user's start (see the module docstring)."""
    import jaxmodels
    from jaxmodels import SamplingParams

    raw = _config(args)
    begin = time.perf_counter()
    model = random_model(raw, args.dtype)
    _block(model)
    weights_s = time.perf_counter() - begin
    call = time.perf_counter()
    llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                        max_seq_len=args.max_seq_len, compilation_cache_dir=args.compilation_cache,
                        warmup=args.warmup, progress=not args.no_progress)
    del model
    constructor_s = time.perf_counter() - call
    before_serving = compile_timings(llm.engine.warmup.timings)
    rng = np.random.default_rng(0)
    vocab = raw["vocab_size"]
    first = rng.integers(3, vocab, size=args.first_in).tolist()
    steps = run_engine(llm.engine, [(0.0, first, SamplingParams(max_new_tokens=args.first_out, temperature=0.0,
                                                                ignore_eos=True))])
    first_request_s = time.perf_counter() - call
    metrics = llm.metrics()
    result = dict(weights_s=weights_s, constructor_s=constructor_s, ready_s=metrics["ready_s"],
                  before_serving=before_serving, first_request_step_ms=[round(s * 1e3, 1) for s in steps.wall],
                  first_request_s=first_request_s, whole_start_s=weights_s + first_request_s,
                  buckets_at_first_request=metrics["buckets_ready"],
                  buckets_total=metrics["buckets_ready"] + metrics["buckets_compiling"])
    if args.stop_after_first:
        llm.close()
        result.update(background_compile_s=None, background=compile_timings([]))
        return result
    if args.serve:
        compiling = llm.metrics()["buckets_compiling"]
        during = serve_phase(llm, args.serve, args.serve_in, args.serve_out, 0.0, vocab, rng, not args.no_progress)
        during.update(buckets_compiling_at_start=compiling, buckets_compiling_at_end=llm.metrics()["buckets_compiling"])
        result["serve_while_compiling"] = during
    if args.warmup == "covering":
        began = time.perf_counter()
        llm.engine.compile_remaining()
        result["background_compile_s"] = time.perf_counter() - began
    else:
        llm.wait_until_compiled()
        result["background_compile_s"] = llm.metrics()["background_compile_s"]
    result["background"] = compile_timings(llm.engine.warmup.timings[len(before_serving["jobs"]):])
    if args.serve:
        result["serve_all_ready"] = serve_phase(llm, args.serve, args.serve_in, args.serve_out, 0.0, vocab, rng,
                                                not args.no_progress)
    return result


def compile_timings(timings: list[tuple]) -> dict:
    """Warmup.timings summed: lowering seconds (on one thread, holding the GIL) and compile seconds (on a pool,
    concurrent), with each program's."""
    return dict(lower_s=sum(t[1] for t in timings), compile_s=sum(t[2] for t in timings),
                jobs=[dict(job=" ".join(str(getattr(x, "name", x)) for x in t[0]), lower_s=round(t[1], 2),
                           compile_s=round(t[2], 2)) for t in timings])


def interpolated(times: dict[int, float]):
    """t(n) for any n in [min, max] of the measured sizes, linear between them, and never less than at a smaller size
    (a larger batch does at least the same work: a dip between sizes is noise, which would show as a negative cost)."""
    sizes = sorted(times)
    rising = np.maximum.accumulate([times[s] for s in sizes])
    return lambda n: float(np.interp(n, sizes, rising))


def padding_cost(times: dict[int, float], buckets: list[int]) -> tuple[float, float]:
    """(mean, worst) of t(bucket(n)) / t(n) - 1 over n = smallest measured size .. the largest bucket."""
    from jaxmodels.engine.buckets import bucket_for

    t = interpolated(times)
    ratios = [t(bucket_for(buckets, n)) / t(n) - 1 for n in range(min(times), max(buckets) + 1)]
    return float(np.mean(ratios)), float(np.max(ratios))


def sglang_like_list(largest: int, kind: str) -> list[int]:
    """The engine's default lists before 2026-12-03, after SGLang's CUDA-graph and piecewise lists: decode 1, 2, 4, 8,
    then by 4 to 32 and by 8; prefill 4-32 by 4, 48-256 by 16, 288-512 by 32, 576-1024 by 64, by 256 to 4096, then
    by 512."""
    if kind == "decode":
        sizes = [1, 2, 4, 8, *range(12, 33, 4), *range(40, largest, 8)]
    else:
        sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
                 *range(1280, 4097, 256), *range(4608, largest, 512)]
    return sorted({s for s in sizes if s < largest} | {largest})


def candidate_lists(largest: int, kind: str) -> dict[str, list[int]]:
    from jaxmodels.engine.buckets import decode_buckets, prefill_buckets

    lists = decode_buckets if kind == "decode" else prefill_buckets
    return {"SGLang-like (old default)": sglang_like_list(largest, kind),
            **{f"{p} per doubling": lists(largest, per_octave=p) for p in (4, 2, 1)}}


def padding_phase(args) -> dict:
    """Step times at each size, then each candidate list's padding cost (see the module docstring)."""
    import jaxmodels
    from jaxmodels.benchmark_floors import model_costs
    from jaxmodels.nnx_params import model_params

    raw = _config(args)
    model = random_model(raw, args.dtype)
    costs = model_costs(model.config, model_params(model), args.dtype, None)
    decode_sizes, prefill_sizes = sorted(args.decode_sizes), sorted(args.prefill_sizes)
    start = time.perf_counter()
    llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, max_batch_size=decode_sizes[-1],
                        max_seq_len=max(prefill_sizes[-1] + 2, args.prompt_len + args.decode_steps + 4),
                        decode_sizes=decode_sizes, prefill_sizes=prefill_sizes, warmup="all",
                        compilation_cache_dir="off", progress=not args.no_progress)
    del model
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(0)
    vocab = raw["vocab_size"]
    decode = [decode_phase(llm, costs, b, args.prompt_len, args.decode_steps, vocab, rng) for b in decode_sizes]
    prefill = [prefill_phase(llm, costs, n, vocab, rng) for n in prefill_sizes]
    step_ms = {row["batch"]: row["step_ms"] for row in decode}
    ttft_ms = {row["tokens"]: row["ttft_ms"] for row in prefill}
    lists = []
    for kind, times in (("decode", step_ms), ("prefill", ttft_ms)):
        for name, buckets in candidate_lists(max(times), kind).items():
            mean, worst = padding_cost(times, buckets)
            lists.append(dict(kind=kind, list=name, buckets=len(buckets), mean_pad=mean, worst_pad=worst,
                              sizes=" ".join(map(str, buckets))))
    return dict(compile_s=compile_s, programs=len(decode_sizes) + len(prefill_sizes), decode=decode,
                prefill=prefill, lists=lists)


def load_phase(args) -> dict:
    """Write (once) and read back a real-size checkpoint of random weights."""
    import jax

    from bridge.export import save_hf_checkpoint
    from jaxmodels.loading import load_model
    from jaxmodels.nnx_params import model_params

    raw = _config(args)
    directory = args.checkpoint
    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        model = random_model(raw, args.dtype)
        begin = time.perf_counter()
        params = {name: np.asarray(value) for name, value in model_params(model).items()}
        prefix = type(model).HF_BASE_PREFIX
        del model
        save_hf_checkpoint(params, raw, directory, base_prefix=prefix)
        print(f"wrote {directory} in {time.perf_counter() - begin:.1f} s")
        del params
    size = os.path.getsize(os.path.join(directory, "model.safetensors"))
    dropped = _drop_page_cache()
    begin = time.perf_counter()
    model = load_model(directory, dtype=args.dtype, progress=not args.no_progress)
    _block(model)
    seconds = time.perf_counter() - begin
    del model
    jax.clear_caches()
    return dict(gigabytes=size / 1e9, load_s=seconds, gb_per_s=size / 1e9 / seconds, page_cache_dropped=dropped)


def lowering_phase(args) -> dict:
    """Where a bucket's lowering and compilation go: the largest decode and prefill programs lowered under cProfile
    (the Python functions that take the most time, own and cumulative), then compiled (no compilation cache)."""
    import cProfile
    import io
    import pstats

    import jaxmodels
    from jaxmodels.step_context import StepKind

    model = random_model(_config(args), args.dtype)
    llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, max_batch_size=args.max_batch_size,
                        max_seq_len=args.max_seq_len, compilation_cache_dir="off", warmup="none", progress=False)
    del model
    programs = llm.engine.runner.programs
    result = []
    for kind in (StepKind.DECODE, StepKind.EXTEND):
        job = programs.bucket_jobs(kind, programs.sizes_of(kind)[-1])[0]
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        lowered = programs.lower(job)
        profile.disable()
        lower_s = time.perf_counter() - began
        began = time.perf_counter()
        lowered.compile()
        compile_s = time.perf_counter() - began
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.profile_rows)
        result.append(dict(job=f"{kind.name} {job[1]}", lower_s=lower_s, compile_s=compile_s,
                           profile=text.getvalue()))
    return dict(programs=result)


def _drop_page_cache() -> bool:
    """Whether the kernel's page cache could be dropped (root on Linux), so that the read comes from the disk."""
    try:
        subprocess.run(["sync"], check=True)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _config(args) -> dict:
    with open(args.config) as f:
        return cut_layers(json.load(f), args.layers)


def report(phase: str, result: dict) -> None:
    if phase == "start":
        print("\n### start (random weights made on the device, then LLM(...) with default options)")
        print(table([result], [("weights s", "weights_s", ".1f"), ("LLM() s", "constructor_s", ".1f"),
                               ("first request served s", "first_request_s", ".1f"),
                               ("whole start s", "whole_start_s", ".1f"),
                               ("buckets ready at the first request", "buckets_at_first_request", "d"),
                               ("buckets", "buckets_total", "d"),
                               ("background compile s", "background_compile_s", ".1f")]))
        runs = [dict(when="while compiling", **result["serve_while_compiling"])] if "serve_while_compiling" in result \
            else []
        runs += [dict(when="all buckets ready", **result["serve_all_ready"])] if "serve_all_ready" in result else []
        if runs:
            print(table(runs, [("", "when", "s"), ("requests", "requests", "d"), ("seconds", "seconds", ".1f"),
                               ("output tok/s", "out_tok_s", ",.0f"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
                               ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
                               ("host share", "host_share", ".1%")]))
        for when in ("before_serving", "background"):
            if when in result:
                part = result[when]
                print(f"{when}: {len(part['jobs'])} programs, lowering {part['lower_s']:.1f} s, compiling "
                      f"{part['compile_s']:.1f} s (summed over threads); " +
                      ", ".join(f"{j['job']} {j['lower_s']}+{j['compile_s']}" for j in part["jobs"][:12]))
        print(f"first request's steps (ms): {result['first_request_step_ms']}")
        print(f"headline: ready in {result['constructor_s']:.1f} s, first request served "
              f"{result['first_request_s']:.1f} s after the LLM call ({result['whole_start_s']:.1f} s with the "
              f"weights); the other buckets compiled in {result['background_compile_s'] or 0:.1f} s")
    elif phase == "padding":
        print(f"\n### step times ({result['programs']} programs compiled in {result['compile_s']:.1f} s)")
        print(table(result["decode"], [("B", "batch", "d"), ("ms / step", "step_ms", ".2f"),
                                       ("tok/s", "tok_s", ",.0f")]))
        print(table(result["prefill"], [("tokens", "tokens", "d"), ("TTFT ms", "ttft_ms", ".1f")]))
        print("\n### padding cost of bucket lists (extra time of a batch padded to its bucket, over all sizes)")
        print(table(result["lists"], [("kind", "kind", "s"), ("list", "list", "s"), ("buckets", "buckets", "d"),
                                      ("mean", "mean_pad", ".1%"), ("worst", "worst_pad", ".1%"),
                                      ("sizes", "sizes", "s")]))
    elif phase == "lowering":
        for program in result["programs"]:
            print(f"\n### {program['job']}: lowered in {program['lower_s']:.2f} s, compiled in "
                  f"{program['compile_s']:.2f} s\n{program['profile']}")
    else:
        print(f"\nload: {result['gigabytes']:.1f} GB in {result['load_s']:.1f} s = {result['gb_per_s']:.2f} GB/s "
              f"(page cache {'dropped' if result['page_cache_dropped'] else 'NOT dropped'})")


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxmodels.benchmark_startup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", choices=["start", "padding", "load", "lowering"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=2008)
    # 1,000 + 1,000 tokens fit the 2008 of max_seq_len (the start issue 44 measured).
    parser.add_argument("--first-in", type=int, default=1000)
    parser.add_argument("--first-out", type=int, default=16)
    parser.add_argument("--serve", type=int, default=256, help="requests of the serving runs (0: none)")
    parser.add_argument("--serve-in", type=int, default=1000)
    parser.add_argument("--serve-out", type=int, default=1000)
    parser.add_argument("--warmup", default="background", choices=["background", "covering", "all"],
                        help="`start`: the engine's warm-up mode ('covering': the background compilation runs after "
                             "the first request, not during it)")
    parser.add_argument("--stop-after-first", action="store_true",
                        help="`start`: stop after the first request (no serving runs, no background compile time)")
    parser.add_argument("--compilation-cache", default="off", metavar="DIR",
                        help="the compilation cache of `start` ('off' by default: a cold start)")
    parser.add_argument("--decode-sizes", type=sizes, default=sizes("1,2,4,8,12,16,24,32,48,64,96,128,160,192,256"))
    parser.add_argument("--prefill-sizes", type=sizes, default=sizes("16,32,64,128,256,512,768,1024,1536,2048"))
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--checkpoint", default=None, help="directory of the real-size checkpoint (`load`)")
    parser.add_argument("--profile-rows", type=int, default=30, help="`lowering`: rows of each profile table")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.phase == "load" and not args.checkpoint:
        parser.error("load needs --checkpoint DIR")
    result = {"start": start_phase, "padding": padding_phase, "load": load_phase,
              "lowering": lowering_phase}[args.phase](args)
    result.update(phase=args.phase, config=args.config, layers=args.layers or "all", dtype=args.dtype)
    report(args.phase, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
