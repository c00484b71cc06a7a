"""Command line: `python -m jaxmodels demo`, `python -m jaxmodels generate --model PATH --prompt "..."` and
`python -m jaxmodels bench --config CONFIG.json ...` (engine vs transformers, see jaxmodels/benchmark.py)."""

import argparse
import logging
import sys


def generate(args) -> None:
    from jaxmodels.llm import LLM, SamplingParams

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SystemExit("give exactly one of --prompt (text, needs tokenizer.json) and --prompt-ids 1,2,3")
    prompt = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
    # One request: compile only the buckets it uses instead of warming up all of them.
    llm = LLM(args.model, dtype=args.dtype, max_batch_size=1, max_seq_len=args.max_seq_len, warmup=False)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    (out,) = llm.generate([prompt], params)
    if out.error:
        raise SystemExit(f"error: {out.error}")
    print(out.text if out.text is not None else out.token_ids)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        from jaxmodels.benchmark import main as bench

        return bench(argv[1:], prog="python -m jaxmodels bench")
    parser = argparse.ArgumentParser(prog="python -m jaxmodels")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="build a small random Nemotron-H checkpoint and serve it")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    commands.add_parser("bench", help="our engine vs transformers generate on a random model (see --help)")
    gen = commands.add_parser("generate", help="generate from a checkpoint directory")
    gen.add_argument("--model", required=True, help="HF checkpoint directory (or one we converted)")
    gen.add_argument("--prompt", help="text prompt (the directory needs a tokenizer.json)")
    gen.add_argument("--prompt-ids", help="comma-separated token ids, for checkpoints without a tokenizer")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--max-seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    # The engine logs its pool sizes and warm-up at INFO; show those (and nothing of other libraries' INFO).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jaxmodels").setLevel(logging.INFO)
    if args.command == "demo":
        from jaxmodels.demo import run_demo

        run_demo(num_requests=args.requests, max_new_tokens=args.max_new_tokens)
    elif args.command == "generate":
        generate(args)


if __name__ == "__main__":
    main()
