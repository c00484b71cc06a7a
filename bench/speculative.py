"""Speculative decoding on the H200: decode time per output token with k MTP drafts against plain decode, at accept
rates 0, about 0.7 and 1, on random weights made on the device (a Nemotron-H or DeepSeek config with one MTP layer).

Accept rate 0: the random MTP layer's drafts (they almost never agree). Accept rate 1: the weights of
`tests/hf_mtp.save_with_drafting_mtp` at target scale 0 (every output projection zero, the MTP layer passing the
next token's embedding through), so every draft is the target's token; the step does the same work either way.
Accept rate about 0.7 (`--drafters noisy --accept 0.72`): that drafter made to disagree on a chosen share of the
tokens (`noisy`), because random weights cannot show what a trained MTP head gives.

    python3 bench/speculative.py --config bench/configs/nemotron_h_nano9b.json --batches 1,32 --ks 1,2,3

Time per output token = (wall time of a generate with --tokens more new tokens - that of a short one) / --tokens,
with every request of the batch decoding in lockstep. Beside each speed-up, its bound: what speculative decoding
could gain at the measured rate per draft if every step moved only its floor's bytes
(`jaxmodels.benchmark_floors.speculative_bound`; routing uniform, so a verify step of k + 1 tokens a request reads
the experts of k + 1 tokens). Prefix caching is off: the random prompts share nothing, and with it on an extend
step saves at most 8 recurrent-state snapshots, so 32 prompts were admitted over four extend steps, out of lockstep
(77 decode steps for 56 tokens at B=32 on 2026-12-04, where 55 make them).

`--floors-only` prints the bounds alone, from the weights' shapes, for any size, on any machine:

    python3 bench/speculative.py --config bench/configs/deepseek_v32.json --batches 1,32 --ks 1,2,3 --floors-only
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
from jaxmodels.benchmark_floors import (  # noqa: E402
    COPY_BANDWIDTH, decode_step_bytes, draft_step_bytes, model_costs, speculative_bound, verify_step_bytes)

OUTPUT_PROJECTIONS = ("out_proj.kernel", "o_proj.kernel", "down_proj.kernel", "experts.down_proj")


def agreeing(model):
    """`model` with the weights of an always-agreeing drafter (see the module docstring). The model given is used up:
    each output projection is freed once its zeros exist, so the device never holds both (DeepSeek 4-layer's routed
    experts are 7 GiB a layer: copying them beside the originals ran out of memory on the H200, 2026-12-04)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.nnx_params import abstract_state, merge_params, model_params

    params = model_params(model)
    hidden = model.config.hidden_size
    for name, value in params.items():
        if name.endswith(OUTPUT_PROJECTIONS):
            params[name] = jnp.zeros_like(value)
            value.delete()
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


def noisy(model, accept: float, sample: int = 4096, seed: int = 0):
    """The agreeing drafter (`agreeing(model)`'s weights) made to disagree on about 1 - `accept` of the tokens: its
    MTP layer's `enorm` weight becomes 1 + s * z (z a fixed random direction), with s found by bisection.

    With every output projection zero, a draft is argmax(head(g * normalize(e_v * w))) for the token v it chains
    on, and the target's token after v is argmax(head(g * normalize(e_v))) (e: embedding rows, g: the final norm's
    weight, w: enorm's weight): so whether a draft stands depends on v alone, and its rate over a sample of the
    vocabulary is computed here without running the model. The benchmark reports the rate it measures (bf16 ties
    lower it a little further)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.nnx_params import abstract_state, merge_params, model_params

    params = model_params(model)
    fusion = "mtp.layers.0." if "mtp.layers.0.enorm.weight" in params else "mtp_layers.0."
    embedding = next(v for n, v in params.items() if n.endswith("embedding") and "mtp" not in n)
    gain = params["norm_f.weight" if "norm_f.weight" in params else "norm.weight"].astype(jnp.float32)
    head = params["lm_head.kernel"]
    tokens = np.random.default_rng(seed).choice(embedding.shape[0], size=min(sample, embedding.shape[0]), replace=False)
    rows = embedding[jnp.asarray(tokens)].astype(jnp.float32)
    direction = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(rows.shape[1]), jnp.float32)

    @jax.jit
    def agreement(scale):
        def predicted(x):
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain
            return jnp.argmax(x.astype(head.dtype) @ head, axis=-1)
        return jnp.mean(predicted(rows) == predicted(rows * (1 + scale * direction)))

    low, high = 0.0, 4.0
    for _ in range(14):
        middle = (low + high) / 2
        low, high = (middle, high) if float(agreement(middle)) > accept else (low, middle)
    scale = (low + high) / 2
    print(f"noisy drafter: enorm = 1 + {scale:.4f} z, drafts standing for {float(agreement(scale)):.3f} of "
          f"{sample} sampled tokens", flush=True)
    params[fusion + "enorm.weight"] = (1 + scale * direction).astype(params[fusion + "enorm.weight"].dtype)
    graphdef, state = nnx.split(model)
    return merge_params(graphdef, abstract_state(state), params)


def costs_of(model):
    from jaxmodels.nnx_params import model_params

    return model_costs(model.config, model_params(model), "bfloat16")


def abstract_costs(raw: dict):
    """The floors' costs of `raw`'s model in bf16 from its weights' shapes alone (nothing allocated)."""
    import jax.numpy as jnp

    from jaxmodels.families import abstract_model, load_config

    config = load_config(raw)
    return model_costs(config, abstract_model(config, jnp.bfloat16)[2], "bfloat16")


def print_bounds(costs, args, context: float) -> None:
    """The speculative bound (`speculative_bound`) at `args.accept` per draft, per batch and k, with the bytes of
    the steps it weighs and their time at the copy bandwidth (to set beside a profile's step times)."""
    print(f"per draft {args.accept}, mean context {context:g}, uniform routing; GB moved per step "
          f"(ms at {COPY_BANDWIDTH / 1e12:g} TB/s):")
    print("| B | decode | drafting pass | " + " | ".join(f"verify, k = {k}" for k in args.ks) + " | "
          + " | ".join(f"bound, k = {k}" for k in args.ks) + " |")
    print("|---" * (3 + 2 * len(args.ks)) + "|")

    def moved(nbytes: float) -> str:
        return f"{nbytes / 1e9:.2f} ({nbytes / COPY_BANDWIDTH * 1e3:.2f})"

    for batch in args.batches:
        verify = [moved(verify_step_bytes(costs, batch, k, context)) for k in args.ks]
        bound = [speculative_bound(costs, batch, k, args.accept, context) for k in args.ks]
        print(f"| {batch} | {moved(decode_step_bytes(costs, batch, context))} | "
              f"{moved(draft_step_bytes(costs, batch, context))} | " + " | ".join(verify)
              + " | " + " | ".join(f"{b:.2f}x" for b in bound) + " |")


def per_token_ms(model, k: int, args, vocab: int, profile: str | None = None) -> list[dict]:
    """One engine (decode buckets: the batch sizes) -> a row per batch size; with `profile`, per-op tables of its
    verify steps at the largest batch too (trace under that directory)."""
    import jaxmodels
    from jaxmodels import SamplingParams

    rng = np.random.default_rng(0)
    llm = jaxmodels.LLM(None, model=model, max_batch_size=max(args.batches),
                        max_seq_len=args.prompt_len + args.tokens + 32, decode_sizes=sorted(args.batches),
                        prefill_sizes=[min(max(args.batches) * args.prompt_len, 2048)], num_speculative_tokens=k,
                        progress=False, warmup="all", enable_prefix_caching=False)
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
                         accept_rate=metrics["spec_accept_rate"],
                         per_draft=metrics["spec_accept_per_draft"], steps=metrics["decode_steps"]))
    if profile:
        print_profile(llm, max(args.batches), args, vocab, rng, profile)
    del llm
    gc.collect()
    return rows


def print_profile(llm, batch: int, args, vocab: int, rng, directory: str, steps: int = 8) -> None:
    from jaxmodels.benchmark import FIRST_DEVICE, profile_decode
    from jaxmodels.profiling import (
        HOST, device_occupancy, format_host_table, format_occupancy, format_op_table, op_table)

    profile_decode(llm, batch, args.prompt_len, steps, vocab, rng, directory)
    print(f"per-op device time of a step, k={llm.engine.num_speculative_tokens}, B={batch}:")
    print(format_op_table(op_table(directory), steps=steps))
    print(format_occupancy(*device_occupancy(directory, FIRST_DEVICE), steps=steps))  # the host's gaps, if any
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
    parser.add_argument("--drafters", default="random,agreeing", type=lambda s: s.split(","),
                        help="random (accept rate 0), agreeing (about 1), noisy (about --accept)")
    parser.add_argument("--accept", type=float, default=0.72, help="the noisy drafter's share of standing drafts")
    parser.add_argument("--profile", default=None, help="trace directory: per-op tables of the first k's verify "
                        "steps (random drafter, largest batch) and of plain decode")
    parser.add_argument("--floors-only", action="store_true", help="print only the speculative bounds at --accept "
                        "per draft for --batches and --ks (abstract weights: any size, on any machine)")
    args = parser.parse_args()
    raw = cut_layers(json.load(open(args.config)), args.layers)
    raw["num_nextn_predict_layers"] = 1
    raw.pop("quantization_config", None)  # served in bf16 here, whatever the checkpoint holds
    if raw["model_type"] == "nemotron_h":
        raw["mtp_layers_block_type"] = args.mtp_blocks.split(",")
    context = args.prompt_len + 8 + args.tokens / 2  # the timed tokens' mean length
    if args.floors_only:
        print_bounds(abstract_costs(raw), args, context)
        return
    model = random_model(raw, "bfloat16")
    costs = costs_of(model)
    rows = []

    def run(model, k, drafter):
        profile = (f"{args.profile}/k{k}" if args.profile and drafter != "agreeing" and k in (0, args.ks[0])
                   else None)
        for row in per_token_ms(model, k, args, raw["vocab_size"], profile):
            rows.append(dict(row, drafter=drafter))
            print(json.dumps(rows[-1]), flush=True)

    run(model, 0, "-")
    if "random" in args.drafters:
        for k in args.ks:
            run(model, k, "random")
    model = agreeing(model)
    if "agreeing" in args.drafters:
        for k in args.ks:
            run(model, k, "agreeing")
    if "noisy" in args.drafters:
        model = noisy(model, args.accept)
        for k in args.ks:
            run(model, k, "noisy")
    plain = {r["batch"]: r["tok_s"] for r in rows if r["k"] == 0}
    print("| drafter | k | B | ms / output token | tok/s | vs plain | bound | accepted / drafted | per draft | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bound = speculative_bound(costs, r["batch"], r["k"], r["per_draft"], context) if r["k"] else 1.0
        r["bound"] = bound
        print(f"| {r['drafter']} | {r['k']} | {r['batch']} | {r['ms_per_token']:.2f} | {r['tok_s']:.0f} | "
              f"{r['tok_s'] / plain[r['batch']]:.2f}x | {bound:.2f}x | {r['accept_rate']:.2f} | {r['per_draft']:.2f} | "
              f"{r['steps']} |")
    print_bounds(costs, args, context)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
