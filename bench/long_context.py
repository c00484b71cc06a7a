"""Long context on the engine: time to first token and decode step time at 8k-128k tokens of context.

    python3 bench/long_context.py --config bench/configs/deepseek_v32_4layer.json --contexts 8192,32768,131072 \
        --batch 16 [--dense]

Random bf16 weights made on the device (`jaxmodels.benchmark.random_model`), one engine sized for `--batch` requests
of the longest context. Two measurements per context L:
  * served: one prompt of L random tokens through `LLM`'s engine (chunked prefill of `--prefill-chunk` tokens,
    paged caches), `--decode-steps` tokens after it: time to first token, and the median decode step (B=1).
  * decode at batch B: the engine's compiled decode executable for B rows, each at context L, its caches filled with
    random values instead of B prefills (the executable and its shapes are the ones serving runs; its time does
    not depend on the cache values, and B prefills of 128k tokens would take minutes per point). Steps are sent
    back to back as the overlapped engine does; ms/step = their wall time / steps.
`--dense` serves the DSA model with `index_topk` past the context, so every query attends to its whole context
(dense MLA): the comparison the sparse path must win. It builds one engine per context, its rows just as long (the
selection is as wide as a row), with prefill chunks of at most 1024 tokens, and serves prompts only up to
`--serve-up-to` tokens (default 8192 there: the sparse kernels walk the whole selection, so a dense prefill costs
minutes; every context otherwise; 0 serves none, for the decode figures and `--profile` alone).
The floor beside each decode figure
is `jaxmodels.benchmark_floors.decode_floor_s`: weights, the cache a step must read, the states, at 4.25 TB/s.
"""

import argparse
import json
import sys
import time
from types import SimpleNamespace

import numpy as np

from jaxmodels.benchmark import cut_layers, random_model, run_engine, table
from jaxmodels.benchmark_floors import decode_floor_s, model_costs, prefill_floor_s
from jaxmodels.step_context import StepKind


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--contexts", default="8192,32768,131072", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--batch", type=int, default=8, help="rows of the decode-at-batch measurement")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--dense", action="store_true", help="DSA: index_topk over the whole context (dense MLA)")
    p.add_argument("--serve-up-to", type=int, default=None,
                   help="serve prompts only up to this context (default: all; 8192 with --dense)")
    p.add_argument("--mamba-ssm-cache-dtype", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None, help="directory: trace the decode at batch B at the longest context "
                   "and print its per-op table")
    return p.parse_args(argv)


def served_request(llm, length: int, steps: int, vocab: int, rng) -> dict:
    """One prompt of `length` tokens, `steps` tokens after it: TTFT and the median steady decode step."""
    from jaxmodels import SamplingParams

    prompt = rng.integers(3, vocab, size=length).tolist()
    first = {}
    start = time.perf_counter()
    log = run_engine(llm.engine, [(0.0, prompt, SamplingParams(max_new_tokens=steps + 2, ignore_eos=True,
                                                                temperature=0.0))],
                     on_token=lambda request, at: first.setdefault(request.request_id, at))
    ttft = next(iter(first.values())) - start
    return dict(ttft_s=ttft, decode_ms=float(np.median([log.wall[i] for i in log.steady_decode(1)])) * 1e3)


def fill_caches_randomly(runner) -> None:
    """Random values in every cache pool, one array at a time (each old pool freed before the next is made)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(runner.caches)
    runner.caches = None
    key = jax.random.key(0)
    for i, leaf in enumerate(leaves):
        shape, dtype = leaf.shape, leaf.dtype
        leaf.delete()
        k = jax.random.fold_in(key, i)
        if dtype == jnp.float32 and len(shape) == 2:  # per-key FP8 scales
            leaves[i] = jax.random.uniform(k, shape, jnp.float32, 0.005, 0.02)
        elif jnp.dtype(dtype).itemsize == 1:  # FP8 index keys
            leaves[i] = (jax.random.normal(k, shape, jnp.bfloat16) * 64).astype(dtype)
        else:
            leaves[i] = jax.random.normal(k, shape, dtype)
        leaves[i].block_until_ready()
    runner.caches = jax.tree.unflatten(treedef, leaves)


def decode_at_batch(llm, batch: int, context: int, steps: int) -> float:
    """ms per step of the engine's decode executable for `batch` rows at `context` tokens each (see the docstring)."""
    from jaxmodels.engine.scheduler import SlotTables

    runner, sizes = llm.engine.runner, llm.engine.sizes
    tables = SlotTables(sizes.num_slots, sizes.pages_per_seq)
    pages = -(-(context + steps + 3) // sizes.page_size)
    rows = [SimpleNamespace(slot=s, num_computed=context) for s in range(1, batch + 1)]
    for row in rows:
        tables.page_table[row.slot, :pages] = 1 + (row.slot - 1) * pages + np.arange(pages)
        tables.prompt_len[row.slot] = context
    tokens = None
    for step in range(steps + 3):
        if step == 3:  # after warm steps, time the rest back to back
            runner.read(tokens)
            start = time.perf_counter()
        for row in rows:
            row.num_computed += 1
        tokens, _ = runner.launch(StepKind.DECODE, [rows], [tables])
    runner.read(tokens)
    return (time.perf_counter() - start) / steps * 1e3


def profile_decode_at_batch(llm, batch: int, context: int, directory: str, steps: int = 8) -> None:
    """The per-op table of `steps` decode steps at batch B and `context` (see decode_at_batch)."""
    from jaxmodels.benchmark import FIRST_DEVICE, traced
    from jaxmodels.profiling import format_op_table, op_table

    path = f"{directory}/decode_b{batch}_ctx{context}"
    traced(path, lambda: decode_at_batch(llm, batch, context, steps))
    print(f"\n## profile: decode B={batch} at context {context}, {steps} steps (+3 warm)")
    print(format_op_table(op_table(path, FIRST_DEVICE), steps=steps + 3))


def build_engine(raw: dict, args, max_seq_len: int, prefill_chunk: int, warmup: bool = True):
    """(LLM on a random model of `raw` with pools for `--batch` requests of max_seq_len, its ModelCosts); with
    `warmup` every bucket compiles before timing, without it each executable compiles when first used (timed steps
    start after warm steps, so that stays out)."""
    import jaxmodels
    from jaxmodels.nnx_params import model_params

    model = random_model(raw, args.dtype)
    costs = model_costs(model.config, model_params(model), args.dtype, args.mamba_ssm_cache_dtype)
    start = time.perf_counter()
    llm = jaxmodels.LLM(None, model=model, dtype=args.dtype, max_batch_size=args.batch, max_seq_len=max_seq_len,
                        prefill_sizes=[prefill_chunk], decode_sizes=sorted({1, args.batch}),
                        num_pages=1 + args.batch * -(-max_seq_len // 16), progress=False,
                        warmup="all" if warmup else False, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    print(f"engine for {args.batch} x {max_seq_len} tokens, prefill chunks of {prefill_chunk}, compiled in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return llm, costs


def measure(llm, costs, contexts, args, vocab: int, rng, serve_up_to: int) -> list[dict]:
    """Decode at batch B at each context, over random caches; then the served prompts up to `serve_up_to` tokens
    (the slower part), which write their own pages."""
    fill_caches_randomly(llm.engine.runner)
    rows = []
    for context in contexts:
        rows.append(dict(context=context, decode_bn_ms=decode_at_batch(llm, args.batch, context, args.decode_steps),
                         decode_bn_floor_ms=decode_floor_s(costs, args.batch, context) * 1e3,
                         decode_b1_floor_ms=decode_floor_s(costs, 1, context) * 1e3))
        print(rows[-1], flush=True)
    if args.profile and contexts:
        profile_decode_at_batch(llm, args.batch, contexts[-1], args.profile)
    served_any = False
    for row in rows:
        if row["context"] <= serve_up_to:
            if not served_any:  # a short request first: an engine without warm-up compiles its executables here
                served_request(llm, 64, 4, vocab, rng)
                served_any = True
            served = served_request(llm, row["context"], args.decode_steps, vocab, rng)
            row.update(ttft_s=served["ttft_s"], prefill_tok_s=row["context"] / served["ttft_s"],
                       prefill_floor_s=prefill_floor_s(costs, row["context"]), decode_b1_ms=served["decode_ms"])
            print(row, flush=True)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax

    with open(args.config) as f:
        raw = cut_layers(json.load(f), args.layers)
    # A context of the model's whole length leaves room for the decode steps after it.
    room = args.decode_steps + 16
    max_seq_len = min(max(args.contexts) + room, raw.get("max_position_embeddings", 4096))
    contexts = [min(context, max_seq_len - room) for context in args.contexts]
    dsa = "index_topk" in raw
    variant = "dense (index_topk >= context)" if args.dense else ("sparse" if dsa else "")
    print(f"{raw['model_type']} {variant} ({args.layers or 'all'} layers) on {jax.devices()[0].device_kind}",
          flush=True)
    rng = np.random.default_rng(0)
    if not args.dense:
        llm, costs = build_engine(raw, args, max_seq_len, args.prefill_chunk)
        serve_up_to = max_seq_len if args.serve_up_to is None else args.serve_up_to
        rows = measure(llm, costs, contexts, args, raw["vocab_size"], rng, serve_up_to=serve_up_to)
    else:
        if not dsa:
            raise SystemExit("--dense is for DSA configs (index_topk)")
        # One engine per context, its rows just long enough: index_topk past them makes every query select its
        # whole context, and the selection is as wide as the context, not as the longest one.
        rows = []
        for context in contexts:
            # Compiled on first use: an engine whose prompts are not served (past --serve-up-to) compiles no extend
            # executable.
            llm, costs = build_engine({**raw, "index_topk": context + room + 16}, args, context + room,
                                      min(args.prefill_chunk, 1024), warmup=False)
            rows += measure(llm, costs, [context], args, raw["vocab_size"], rng,
                            serve_up_to=8192 if args.serve_up_to is None else args.serve_up_to)
            del llm
    print(f"\n### {raw['model_type']} {variant}: served prompt (B=1) and decode at B={args.batch}")
    print(table(rows, [("context", "context", "d"), ("TTFT s", "ttft_s", ".2f"),
                       ("prefill tok/s", "prefill_tok_s", ",.0f"), ("prefill floor s", "prefill_floor_s", ".2f"),
                       ("decode B=1 ms", "decode_b1_ms", ".2f"), ("floor", "decode_b1_floor_ms", ".2f"),
                       (f"decode B={args.batch} ms", "decode_bn_ms", ".2f"), ("floor", "decode_bn_floor_ms", ".2f")]))
    stats = jax.devices()[0].memory_stats() or {}
    print(f"peak device memory {stats.get('peak_bytes_in_use', 0) / 1e9:.1f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=args.config, dense=args.dense, batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
