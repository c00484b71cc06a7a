"""The serving benchmark's comparator: transformers' `generate` on a random model of the same config, run in its
own process by `jaxmodels.benchmark --compare-transformers` (torch and JAX never share the GPU's memory).

    python -m jaxmodels.benchmark_transformers --config CONFIG.json --batches 1,32 --json out.json

Decode: ms per step is the difference of two `generate` lengths (prompt + 8 and prompt + 8 + steps new tokens,
EOS off) over the extra steps, so prefill cancels out. Prefill: for each length of `--prefill-len`, one prompt, one
new token, run once untimed (torch's first call at a new shape pays for its kernels' set-up: measured once, DeepSeek's
1k prompt took 709 ms and its 4k one 193 ms), then the median of `PREFILL_REPEATS` timed runs, as our engine's prefill
phase takes them. A size that runs out of memory is recorded as such and the next one is tried.
"""

import argparse
import json
import time

import numpy as np

from jaxmodels.benchmark import PREFILL_REPEATS, cut_layers


def build(raw: dict, dtype: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # exactly the asked number of tokens
    return model.eval()


def timed_generate(model, prompts: np.ndarray, new_tokens: int) -> float:
    import torch

    ids = torch.as_tensor(prompts, device=model.device)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def guarded(measure):
    """measure() -> dict, or {"error": "OOM"} when the size does not fit."""
    import torch

    try:
        return measure()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"error": "OOM"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-len", default="4096", type=lambda s: [int(x) for x in s.split(",")],
                        help="prompt lengths, comma-separated")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    with open(args.config) as f:
        raw = cut_layers(json.load(f), args.layers)
    model = build(raw, args.dtype, args.device)
    rng = np.random.default_rng(0)
    vocab = raw["vocab_size"]
    timed_generate(model, rng.integers(3, vocab, size=(1, 8)), 2)  # warm-up

    def decode(batch):
        prompts = rng.integers(3, vocab, size=(batch, args.prompt_len))
        short = timed_generate(model, prompts, 8)
        long = timed_generate(model, prompts, 8 + args.decode_steps)
        step = (long - short) / args.decode_steps
        return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step}

    def prefill(length):
        prompt = rng.integers(3, vocab, size=(1, length))
        timed_generate(model, prompt, 1)
        seconds = float(np.median([timed_generate(model, prompt, 1) for _ in range(PREFILL_REPEATS)]))
        return {"ttft_ms": seconds * 1e3, "tok_s": length / seconds}

    results = {"decode": [], "prefill_sweep": []}
    for length in args.prefill_len:
        row = {"tokens": length, **guarded(lambda: prefill(length))}
        results["prefill_sweep"].append(row)
        print(f"transformers prefill {length}: {row}", flush=True)
    # The longest prompt's row under the key readers of a single length know.
    results["prefill"] = max(results["prefill_sweep"], key=lambda row: row["tokens"])
    for batch in args.batches:
        row = guarded(lambda: decode(batch))
        results["decode"].append({"batch": batch, **row})
        print(f"transformers decode B={batch}: {row}", flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
