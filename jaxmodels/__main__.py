"""Command line: `python -m jaxmodels demo`, `python -m jaxmodels generate --model PATH --prompt "..."`,
`python -m jaxmodels serve --model PATH` (an OpenAI-compatible server, see jaxmodels/serve/),
`python -m jaxmodels bench --config CONFIG.json ...` (engine vs transformers, see jaxmodels/benchmark.py),
`python -m jaxmodels bench-report RESULTS.json ... --plot DIR --markdown OUT.md | --update PAGE.md` (its figures
and tables, see jaxmodels/benchmark_report.py) and `python -m jaxmodels plan --config CONFIG.json --dp D --tp T`
(memory and collectives on a mesh, jaxmodels/plan.py)."""

import argparse
import logging
import os
import sys

from jaxmodels.serve.reasoning import REASONING_PARSERS  # these three: the standard library only
from jaxmodels.serve.security import DEFAULT_MAX_REQUEST_BYTES, faces_network
from jaxmodels.serve.tool_calls import TOOL_CALL_PARSERS

SPECULATIVE_HELP = "draft this many tokens per step with the checkpoint's MTP layers (0: off)"
QUANTIZATION_HELP = "an FP8 checkpoint runs in FP8 unless 'dequantize' converts its weights to --dtype on load"
SSM_STATE_HELP = "Nemotron-H's SSM state dtype (default: the config's, float32); bfloat16 halves the state's traffic"
PREFIX_CACHING_HELP = ("do not keep computed pages for later requests that start with the same tokens (prefix "
                       "caching is on by default)")
MAMBA_CACHE_SLOTS_HELP = ("recurrent-state snapshots a hybrid model keeps for prefix caching, per dp group (default: "
                          "1.25 x max-batch-size / dp; each takes what one request's Mamba state does)")
API_KEY_ENV = "JAXMODELS_API_KEY"
API_KEY_HELP = (f"answer 401 to requests without the header 'Authorization: Bearer KEY', on every route but /health "
                f"and /metrics (default: ${API_KEY_ENV}, which keeps the key out of the process list)")
HOST_HELP = ("the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 takes connections from the "
             "network: set an API key)")
MAX_REQUEST_BYTES_HELP = (f"answer 413 to a request body over this many bytes, unread (default: "
                          f"{DEFAULT_MAX_REQUEST_BYTES // 2**20} MiB, a million-token prompt as JSON)")
REASONING_PARSER_HELP = ("split chat output into reasoning_content and content with this format's parser; auto "
                         "(default): the checkpoint's own (from its model_type and chat template), none: no parsing")
TOOL_CALL_PARSER_HELP = ("read tool calls from chat output (requests with tools) with this format's parser; auto "
                         "(default): the checkpoint's own, none: no parsing (tool calls stay content)")
CACHE_HELP = ("keep the compiled step programs in this directory and load them on the next start with the same "
              "model and limits; 'off' compiles without (default: $JAXMODELS_COMPILATION_CACHE_DIR, else JAX's own "
              "cache directory if set, else ~/.cache/jaxmodels/xla)")


def generate(args) -> None:
    from jaxmodels.llm import LLM, SamplingParams

    if (args.prompt is None) == (args.prompt_ids is None):
        raise SystemExit("give exactly one of --prompt (text, needs tokenizer.json) and --prompt-ids 1,2,3")
    prompt = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
    # One request: compile only the buckets it uses instead of warming up all of them.
    llm = LLM(args.model, dtype=args.dtype, max_batch_size=1, max_seq_len=args.max_seq_len, warmup=False,
              num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, compilation_cache_dir=args.compilation_cache,
              enable_prefix_caching=not args.no_prefix_caching)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    (out,) = llm.generate([prompt], params)
    if out.error:
        raise SystemExit(f"error: {out.error}")
    print(out.text if out.text is not None else out.token_ids)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")


def serve(args) -> None:
    import jax

    try:
        from jaxmodels.serve.server import follow_leader, load_app, serve_forever, stop_job, stop_process
    except ImportError as e:
        raise SystemExit(f"serve needs the [serve] extra (pip install 'jaxmodels[serve]'): {e}")
    from jaxmodels.engine.mirror import MirrorFailed
    from jaxmodels.hub import resolve_model_path

    try:
        model_dir = resolve_model_path(args.model)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}")
    llm_options = dict(dtype=args.dtype, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                       dp=args.dp, tp=args.tp, max_prefill_tokens=args.max_prefill_tokens, warmup=args.warmup,
                       num_speculative_tokens=args.num_speculative_tokens, quantization=args.quantization,
                       memory_fraction=args.memory_fraction, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                       compilation_cache_dir=args.compilation_cache, enable_prefix_caching=not args.no_prefix_caching,
                       mamba_cache_slots=args.mamba_cache_slots)
    if jax.process_index() > 0:  # of a multi-process job: process 0 serves HTTP, this one steps with it
        try:
            follow_leader(model_dir, **llm_options)
        except MirrorFailed as e:
            raise SystemExit(f"error: {e}")
        return
    api_key = resolve_api_key(args.api_key)
    if api_key is None and faces_network(args.host):
        logging.getLogger("jaxmodels.serve").warning(
            "serving on %s without an API key: whoever reaches the port can use the model (see --api-key)", args.host)
    failures = []

    def failed(message: str) -> None:
        failures.append(f"the model failed to load: {message}")
        stop_process(message)

    def job_failed(message: str) -> None:
        failures.append(message)
        stop_job(message)

    # The server answers at once (/health: 503 "loading") and serves once the model is loaded.
    app = load_app(model_dir, model_name=args.served_model_name or args.model, on_load_failure=failed,
                   on_job_failure=job_failed, max_queued_requests=args.max_queued_requests, api_key=api_key,
                   max_request_bytes=args.max_request_bytes, reasoning_parser=args.reasoning_parser,
                   tool_call_parser=args.tool_call_parser, **llm_options)
    serve_forever(app, args.host, args.port)
    if failures:
        raise SystemExit(f"error: {failures[0]}")


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else $JAXMODELS_API_KEY; None (no key) where neither is set, or the variable is empty."""
    if flag == "":
        raise SystemExit("error: --api-key is empty; leave it out to serve without a key")
    return flag if flag is not None else os.environ.get(API_KEY_ENV) or None


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # arranges its (simulated) devices before jax starts, and parses its own options
        from jaxmodels.plan import main as plan

        return plan(argv[1:], prog="python -m jaxmodels plan")
    if argv[:1] == ["bench-report"]:  # reads JSONs: no devices, and its own options
        from jaxmodels.benchmark_report import main as bench_report

        return bench_report(argv[1:], prog="python -m jaxmodels bench-report")
    from sharding import initialize_distributed

    initialize_distributed()  # a multi-host job when JAX_COORDINATOR_ADDRESS says so (see sharding.mesh)
    if argv[:1] == ["bench"]:  # the benchmark parses its own options
        from jaxmodels.benchmark import main as bench

        return bench(argv[1:], prog="python -m jaxmodels bench")
    parser = argparse.ArgumentParser(prog="python -m jaxmodels")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="build a small random Nemotron-H checkpoint and serve it")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    commands.add_parser("bench", help="our engine vs transformers generate on a random model (see --help)")
    commands.add_parser("bench-report", help="figures (--plot DIR) and markdown tables of saved bench JSONs (see "
                                             "--help)")
    commands.add_parser("plan", help="memory per device and decode collectives of a model on a mesh, compiled from "
                                     "abstract shapes (see --help)")
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
    gen.add_argument("--max-seq-len", type=int, default=None,
                     help="prompt + output tokens per request (default: 4096, or max_position_embeddings if smaller)")
    gen.add_argument("--num-speculative-tokens", type=int, default=0, help=SPECULATIVE_HELP)
    gen.add_argument("--quantization", choices=["dequantize"], default=None, help=QUANTIZATION_HELP)
    gen.add_argument("--mamba-ssm-cache-dtype", choices=["float32", "bfloat16"], default=None, help=SSM_STATE_HELP)
    gen.add_argument("--compilation-cache", default=None, metavar="DIR", help=CACHE_HELP)
    gen.add_argument("--no-prefix-caching", action="store_true", help=PREFIX_CACHING_HELP)
    srv = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the [serve] extra)")
    srv.add_argument("--model", required=True, help="HF checkpoint directory, or a Hugging Face Hub id")
    srv.add_argument("--served-model-name", help="the id clients send as `model` (default: --model as given)")
    srv.add_argument("--host", default="127.0.0.1", help=HOST_HELP)
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--dtype", default="bfloat16")
    srv.add_argument("--max-batch-size", type=int, default=64)
    srv.add_argument("--max-seq-len", type=int, default=None,
                     help="prompt + output tokens per request (default: 4096, or max_position_embeddings if smaller)")
    srv.add_argument("--quantization", choices=["dequantize"], default=None, help=QUANTIZATION_HELP)
    srv.add_argument("--max-prefill-tokens", type=int, default=None, help="tokens per prefill step")
    srv.add_argument("--memory-fraction", type=float, default=None,
                     help="size the KV pages to this fraction of the GPU memory left after the weights (default: the "
                          "pages max-batch-size requests of max-seq-len take, within 90%% of it)")
    srv.add_argument("--dp", type=int, default=1)
    srv.add_argument("--tp", type=int, default=1)
    srv.add_argument("--num-speculative-tokens", type=int, default=0, help=SPECULATIVE_HELP)
    srv.add_argument("--max-queued-requests", type=int, default=1024,
                     help="requests held beyond the running batch; past that, new ones get 503")
    srv.add_argument("--api-key", default=None, metavar="KEY", help=API_KEY_HELP)
    srv.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help=MAX_REQUEST_BYTES_HELP)
    srv.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *sorted(REASONING_PARSERS)],
                     help=REASONING_PARSER_HELP)
    srv.add_argument("--tool-call-parser", default="auto", choices=["auto", "none", *sorted(TOOL_CALL_PARSERS)],
                     help=TOOL_CALL_PARSER_HELP)
    srv.add_argument("--mamba-ssm-cache-dtype", choices=["float32", "bfloat16"], default=None, help=SSM_STATE_HELP)
    srv.add_argument("--compilation-cache", default=None, metavar="DIR", help=CACHE_HELP)
    srv.add_argument("--no-prefix-caching", action="store_true", help=PREFIX_CACHING_HELP)
    srv.add_argument("--mamba-cache-slots", type=int, default=None, help=MAMBA_CACHE_SLOTS_HELP)
    srv.add_argument("--warmup", choices=["background", "all", "none"], default="background",
                     help="background (default): serve once the largest prefill and decode buckets are compiled, the "
                          "others compiling meanwhile; all: compile every bucket first; none: compile each on first "
                          "use (slow first requests)")
    srv.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", help="the same as --warmup none")
    args = parser.parse_args(argv)
    # The engine logs its pool sizes and warm-up at INFO; show those (and nothing of other libraries' INFO).
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jaxmodels").setLevel(logging.INFO)
    if args.command == "demo":
        from jaxmodels.demo import run_demo

        run_demo(num_requests=args.requests, max_new_tokens=args.max_new_tokens)
    elif args.command == "generate":
        generate(args)
    elif args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
