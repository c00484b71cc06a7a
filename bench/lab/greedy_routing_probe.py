"""How many distinct next tokens, and distinct experts per MoE layer, a batch of random prompts gets from greedy
decoding of the benchmark's random model (`jaxmodels.benchmark.random_model`: routing balanced and LM head centered
on a prompt; `--uncentered-head` leaves the head as drawn, where greedy decoding collapses onto a few tokens).

The serving benchmark's floor assumes each token picks its experts uniformly; this shows whether the benchmark's own
decode tokens do. Runs on the CPU; `--moe-intermediate` cuts the experts' width so the real hidden size and depth fit
in memory (routing depends on the hidden states, not on the experts' width beyond their output's scale).

    PYTHONPATH=. python bench/lab/greedy_routing_probe.py --config bench/configs/nemotron_h_nano30b_a3b.json \
        --moe-intermediate 64 --batch 32 --steps 4 [--uncentered-head]
    PYTHONPATH=. python bench/lab/greedy_routing_probe.py --config bench/configs/deepseek_v32_4layer.json \
        --moe-intermediate 64 --batch 32 --prompt-len 16 --chunk 4    # about 10 minutes on 2 cores
"""

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--moe-intermediate", type=int, default=None, help="cut each expert to this width")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=32,
                        help="prompts per forward (fewer hold less: on CPU the grouped matmul's XLA reference masks "
                             "the tokens' rows once per expert, and 32 x 16 tokens at the DeepSeek shape went past "
                             "23 GB)")
    parser.add_argument("--uncentered-head", action="store_true",
                        help="leave the LM head as drawn (random_model centers it: jaxmodels.benchmark.center_lm_head)")
    args = parser.parse_args()

    import jax.numpy as jnp

    from jaxmodels.benchmark import random_model
    from jaxmodels.layers.moe import MoE

    with open(args.config) as f:
        raw = json.load(f)
    if args.moe_intermediate:
        raw["moe_intermediate_size"] = args.moe_intermediate
    model = random_model(raw, "bfloat16", center_head=not args.uncentered_head)
    experts, k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    uniform = experts * (1 - (1 - k / experts) ** args.batch)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, raw["vocab_size"], size=(args.batch, args.prompt_len)))
    picks = []  # per forward, each MoE layer's experts for each prompt's last token
    route = MoE.route

    def recording_route(self, x):
        weights, chosen = route(self, x)
        picks.append(np.asarray(chosen).reshape(forward_batch, -1, chosen.shape[-1])[:, -1])
        return weights, chosen

    MoE.route = recording_route
    try:
        for step in range(args.steps):
            by_chunk, next_tokens = [], []
            for first in range(0, args.batch, args.chunk):
                picks.clear()
                chunk = ids[first:first + args.chunk]
                forward_batch = chunk.shape[0]
                next_tokens.append(jnp.argmax(model(chunk)[:, -1], axis=-1))
                by_chunk.append(list(picks))
            next_tokens = jnp.concatenate(next_tokens)
            touched = [len(np.unique(np.concatenate(layer))) for layer in zip(*by_chunk)]
            print(f"step {step}: {len(set(np.asarray(next_tokens).tolist()))} distinct next tokens of {args.batch}; "
                  f"experts touched per MoE layer {touched} (uniform routing: {uniform:.1f})", flush=True)
            ids = jnp.concatenate([ids, next_tokens[:, None]], axis=1)
    finally:
        MoE.route = route


if __name__ == "__main__":
    main()
