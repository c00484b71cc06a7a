"""Serving over HTTP against LLM.generate on the same work: N concurrent streaming requests through the server vs
the same prompts through `LLM.generate`, output tok/s side by side.

    python bench/serve_load.py --config bench/configs/nemotron_h_nano9b.json --requests 256 --prompt-len 128 \
        --max-tokens 128                                      # random weights at a real model's shapes
    python bench/serve_load.py --model DIR --requests 256     # a checkpoint
    python bench/serve_load.py --smoke                        # a tiny random model, runs on CPU in under a minute

Both runs use one engine (warmed up first), greedy decoding and ignore_eos, so both produce requests x max_tokens
tokens. The HTTP client runs in its own process (`jaxmodels.serve.load_client`). The last line is the headline.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxmodels.benchmark import cut_layers, percentile_ms, random_model, table


def build_llm(args):
    from jaxmodels.llm import LLM

    limits = dict(dtype=args.dtype, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                  max_prefill_tokens=args.max_prefill_tokens, progress=not args.no_progress,
                  warmup="all")  # the timed runs measure the engine with every bucket ready
    if args.model is not None:
        return LLM(args.model, **limits)
    if args.smoke:
        from jaxmodels.demo import DEMO_CONFIG

        raw = DEMO_CONFIG
        # One bucket of each kind: little to compile on CPU.
        limits.update(prefill_sizes=[args.max_prefill_tokens], decode_sizes=[args.max_batch_size])
    else:
        with open(args.config) as f:
            raw = cut_layers(json.load(f), args.layers)
    return LLM(None, model=random_model(raw, args.dtype), **limits)


def generate_run(llm, prompts, max_tokens: int) -> dict:
    from jaxmodels.llm import SamplingParams

    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - start
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"LLM.generate refused a prompt: {errors[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    return {"run": "LLM.generate", "requests": len(prompts), "tokens": tokens, "seconds": wall,
            "out_tok_s": tokens / wall}


def http_run(llm, prompts, max_tokens: int) -> dict:
    from jaxmodels.serve.app import build_app
    from jaxmodels.serve.server import BackgroundServer

    app = build_app(llm, model_name="bench", max_queued_requests=len(prompts))
    with tempfile.TemporaryDirectory() as tmp, BackgroundServer(app) as server:
        prompts_file = os.path.join(tmp, "prompts.json")
        with open(prompts_file, "w") as f:
            json.dump(prompts, f)
        result = subprocess.run([sys.executable, "-m", "jaxmodels.serve.load_client", "--url", server.url,
                                 "--prompts", prompts_file, "--max-tokens", str(max_tokens)],
                                capture_output=True, text=True, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    errors = [r["error"] for r in report["results"] if "error" in r]
    if errors:
        raise SystemExit(f"{len(errors)} HTTP requests failed, e.g. {errors[0]}")
    streams = report["results"]
    ttft = [s["arrivals"][0] for s in streams if s["arrivals"]]
    gaps = np.concatenate([np.diff(s["arrivals"]) for s in streams if len(s["arrivals"]) > 1] or [np.zeros(0)])
    tokens = sum(s["tokens"] for s in streams)
    return {"run": "HTTP streams", "requests": len(prompts), "tokens": tokens, "seconds": report["wall_s"],
            "out_tok_s": tokens / report["wall_s"], "ttft_p50_ms": percentile_ms(ttft, 50),
            "ttft_p99_ms": percentile_ms(ttft, 99), "itl_p50_ms": percentile_ms(gaps, 50),
            "itl_p99_ms": percentile_ms(gaps, 99)}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="bench/serve_load.py", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a checkpoint directory or Hub id")
    source.add_argument("--config", help="an HF config.json: random weights at its shapes (bench/configs/)")
    source.add_argument("--smoke", action="store_true", help="a tiny random model with small limits (CPU)")
    parser.add_argument("--layers", type=int, default=None, help="with --config: keep only the first N layers")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--max-prefill-tokens", type=int, default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in dict(dtype="float32", requests=16, prompt_len=12, max_tokens=16, max_batch_size=8,
                                max_seq_len=64, max_prefill_tokens=32).items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    llm = build_llm(args)
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, vocab, size=(args.requests, args.prompt_len)).tolist()
    generate_run(llm, prompts[: min(len(prompts), 8)], 2)  # compiles whatever warm-up left (none with warm-up on)
    rows = [generate_run(llm, prompts, args.max_tokens), http_run(llm, prompts, args.max_tokens)]
    print(table(rows, [("run", "run", ""), ("requests", "requests", "d"), ("output tokens", "tokens", "d"),
                       ("seconds", "seconds", ".2f"), ("output tok/s", "out_tok_s", ",.0f"),
                       ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
                       ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f")]))
    generate, http = rows
    print(f"headline: HTTP {http['out_tok_s']:,.0f} output tok/s = {http['out_tok_s'] / generate['out_tok_s']:.0%} "
          f"of LLM.generate's {generate['out_tok_s']:,.0f} ({args.requests} concurrent streams)")
