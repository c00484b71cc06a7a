"""Our serving engine against transformers' `generate` on the same random model, GPU, batch and lengths.

    python -m jaxmodels bench --config bench/configs/nemotron_h_nano9b.json --layers 8 --batch 16 \
        --prompt-len 512 --new-tokens 128

(`bench/engine_vs_transformers.py` runs the same from a checkout without installing.)

One random transformers model is built from the config (optionally cut to its first `--layers` layers) and our
model is made from the same weights in memory (`bridge.from_torch`). Both generate greedily, exactly
`--new-tokens` tokens for every prompt (EOS ignored), from the same prompts. Times are wall-clock around the whole
call (our engine returns host tokens, so it has synchronized; torch is synchronized explicitly), after one warm-up
call each; our bucket compilation is reported apart. The floor is the weight bytes read once per decode step at the
copy bandwidth (KV and state traffic ignored, so the real floor is a little higher).

The last line is the headline: our decode-inclusive tokens/s over transformers'.
"""

import argparse
import json
import time

import numpy as np

COPY_BANDWIDTH = 4.25e12  # bytes/s, device-to-device copy measured on the H200 (DESIGN.md)


def cut_layers(raw: dict, layers: int | None) -> dict:
    """The config with only its first `layers` layers (all when None)."""
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    if layers is None:
        return raw
    if raw["model_type"] == "nemotron_h":
        raw["hybrid_override_pattern"] = raw["hybrid_override_pattern"][:layers]
        raw.pop("layers_block_type", None)
    raw["num_hidden_layers"] = layers
    return raw


def build_transformers_model(raw: dict, dtype: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def time_transformers(model, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
    import torch

    ids = torch.as_tensor(prompts, device=model.device)
    # No EOS: exactly n tokens, EOS sampled like any other token (our side: ignore_eos). `min_new_tokens` would
    # instead forbid EOS and change the greedy choice.
    model.generation_config.eos_token_id = None

    def run(n):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
        if ids.is_cuda:
            torch.cuda.synchronize()
        return out

    run(2)
    start = time.perf_counter()
    out = run(new_tokens)
    return time.perf_counter() - start, out[:, prompts.shape[1]:].cpu().numpy()


def time_ours(model, prompts: np.ndarray, new_tokens: int, dtype: str, prefill_chunk: int):
    import jaxmodels

    batch, prompt_len = prompts.shape
    start = time.perf_counter()
    # Two executables: every prompt arrives at once, so extends are full `prefill_chunk`-token chunks and every
    # decode step runs the whole batch (all requests stop together).
    llm = jaxmodels.LLM(None, model=model, dtype=dtype, max_batch_size=batch, max_seq_len=prompt_len + new_tokens + 1,
                        prefill_sizes=[prefill_chunk], decode_sizes=[batch])
    compile_s = time.perf_counter() - start
    params = jaxmodels.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:, :8].tolist(), jaxmodels.SamplingParams(max_new_tokens=2, temperature=0.0))
    start = time.perf_counter()
    outs = llm.generate(prompts.tolist(), params)
    elapsed = time.perf_counter() - start
    return elapsed, compile_s, np.array([o.token_ids for o in outs])


def main(argv=None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="an HF config.json (real shapes: bench/configs/)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per extend step (one bucket)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="torch device of the transformers model")
    args = parser.parse_args(argv)

    import jax

    from bridge import from_torch

    with open(args.config) as f:
        raw = cut_layers(json.load(f), args.layers)
    hf_model = build_transformers_model(raw, args.dtype, args.device)
    model = from_torch(hf_model, args.dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    prompts = np.random.default_rng(0).integers(3, raw["vocab_size"], size=(args.batch, args.prompt_len))

    hf_s, hf_tokens = time_transformers(hf_model, prompts, args.new_tokens)
    del hf_model
    ours_s, compile_s, our_tokens = time_ours(model, prompts, args.new_tokens, args.dtype, args.prefill_chunk)

    generated = args.batch * args.new_tokens
    floor_s = args.new_tokens * weight_bytes / COPY_BANDWIDTH
    agree = float((hf_tokens[:, :8] == our_tokens[:, :8]).mean())
    print(f"model {raw['model_type']} ({args.layers or 'all'} layers, {weight_bytes / 1e9:.2f} GB of weights, "
          f"{args.dtype}), batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{jax.devices()[0].device_kind}")
    print(f"{'':14s}{'seconds':>10s}{'tokens/s':>12s}")
    print(f"{'transformers':14s}{hf_s:10.3f}{generated / hf_s:12.1f}")
    print(f"{'jaxmodels':14s}{ours_s:10.3f}{generated / ours_s:12.1f}   (+{compile_s:.1f} s bucket compilation)")
    print(f"{'decode floor':14s}{floor_s:10.3f}{generated / floor_s:12.1f}   (weights read once per step)")
    print(f"first 8 greedy tokens equal to transformers': {agree:.0%} of positions")
    print(f"headline: jaxmodels {generated / ours_s:.1f} tokens/s = {hf_s / ours_s:.2f}x transformers")


if __name__ == "__main__":
    main()
