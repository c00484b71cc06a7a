"""Speculative decoding on the H200: decode time per output token with k MTP drafts against plain decode, at accept
rates 1 and 0, on random weights made on the device (a Nemotron-H config with one MTP layer added).

Accept rate 0: the random MTP layer's drafts (they almost never agree). Accept rate 1: the weights of
`tests/hf_mtp.save_with_drafting_mtp` at target scale 0 (every output projection zero, the MTP layer passing the
next token's embedding through), so every draft is the target's token; the step does the same work either way.

    python3 bench/speculative.py --config bench/configs/nemotron_h_nano9b.json --batches 1,32 --ks 1,2,3

Time per output token = (wall time of a generate with --tokens more new tokens - that of a short one) / --tokens,
with every request of the batch decoding in lockstep.
"""

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxmodels.benchmark import cut_layers, random_model  # noqa: E402

OUTPUT_PROJECTIONS = ("out_proj.kernel", "o_proj.kernel", "down_proj.kernel", "experts.down_proj")


def agreeing(model):
    """`model` with the weights of an always-agreeing drafter (see the module docstring)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.nnx_params import abstract_state, merge_params, model_params

    params = model_params(model)
    hidden = model.config.hidden_size
    for name, value in params.items():
        if name.endswith(OUTPUT_PROJECTIONS):
            params[name] = jnp.zeros_like(value)
    fusion = "mtp.layers.0." if "mtp.layers.0.eh_proj.kernel" in params else "mtp_layers.0."
    eh = params[fusion + "eh_proj.kernel"]
    params[fusion + "eh_proj.kernel"] = jnp.concatenate([jnp.eye(hidden, dtype=eh.dtype),
                                                          jnp.zeros((hidden, hidden), eh.dtype)])
    params[fusion + "enorm.weight"] = jnp.ones_like(params[fusion + "enorm.weight"])
    final = [name for name in params if name.endswith(("final_layernorm.weight", "shared_head.norm.weight"))]
    target_norm = params["norm_f.weight" if "norm_f.weight" in params else "norm.weight"]
    for name in final:
        params[name] = target_norm
    graphdef, state = nnx.split(model)
    return merge_params(graphdef, abstract_state(state), params)


def per_token_ms(model, k: int, args, vocab: int, profile: str | None = None) -> list[dict]:
    """One engine (decode buckets: the batch sizes) -> a row per batch size; with `profile`, per-op tables of its
    verify steps at the largest batch too (trace under that directory)."""
    import jaxmodels
    from jaxmodels import SamplingParams

    rng = np.random.default_rng(0)
    llm = jaxmodels.LLM(None, model=model, max_batch_size=max(args.batches),
                        max_seq_len=args.prompt_len + args.tokens + 32, decode_sizes=sorted(args.batches),
                        prefill_sizes=[min(max(args.batches) * args.prompt_len, 2048)], num_speculative_tokens=k,
                        progress=False, warmup="all")
    rows = []
    for batch in args.batches:
        prompts = rng.integers(3, vocab, size=(batch, args.prompt_len)).tolist()
        times = {}
        for new in (8, 8 + args.tokens):
            params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
            llm.generate(prompts, params)  # the same shapes once before timing
            llm.engine.reset_metrics()
            start = time.perf_counter()
            llm.generate(prompts, params)
            times[new] = time.perf_counter() - start
        metrics = llm.metrics()
        ms = (times[8 + args.tokens] - times[8]) / args.tokens * 1e3
        rows.append(dict(k=k, batch=batch, ms_per_token=ms, tok_s=batch / ms * 1e3,
                         accept_rate=metrics["spec_accept_rate"], steps=metrics["decode_steps"]))
    if profile:
        print_profile(llm, max(args.batches), args, vocab, rng, profile)
    del llm
    gc.collect()
    return rows


def print_profile(llm, batch: int, args, vocab: int, rng, directory: str, steps: int = 8) -> None:
    from jaxmodels.benchmark import profile_decode
    from jaxmodels.profiling import HOST, format_host_table, format_op_table, op_table

    profile_decode(llm, batch, args.prompt_len, steps, vocab, rng, directory)
    print(f"per-op device time of a step, k={llm.engine.num_speculative_tokens}, B={batch}:")
    print(format_op_table(op_table(directory), steps=steps))
    print(format_host_table(op_table(directory, HOST), steps=steps))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--ks", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--mtp-blocks", default="attention,mlp", help="the MTP layer's block kinds (Nemotron-H)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default=None, help="trace directory: per-op tables of the first k's verify "
                        "steps (random drafter, largest batch) and of plain decode")
    args = parser.parse_args()
    raw = cut_layers(json.load(open(args.config)), args.layers)
    raw["num_nextn_predict_layers"] = 1
    if raw["model_type"] == "nemotron_h":
        raw["mtp_layers_block_type"] = args.mtp_blocks.split(",")
    model = random_model(raw, "bfloat16")
    rows = []

    def run(model, k, drafter):
        profile = (f"{args.profile}/k{k}" if args.profile and drafter != "agreeing" and k in (0, args.ks[0])
                   else None)
        for row in per_token_ms(model, k, args, raw["vocab_size"], profile):
            rows.append(dict(row, drafter=drafter))
            print(json.dumps(rows[-1]), flush=True)

    run(model, 0, "-")
    for k in args.ks:
        run(model, k, "random")
    model = agreeing(model)
    for k in args.ks:
        run(model, k, "agreeing")
    print("| drafter | k | B | ms / output token | tok/s | accept rate | verify steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['k']} | {r['batch']} | {r['ms_per_token']:.2f} | {r['tok_s']:.0f} | "
              f"{r['accept_rate']:.2f} | {r['steps']} |")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
