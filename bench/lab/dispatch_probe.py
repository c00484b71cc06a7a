"""Where the host time of one decode launch goes: the forward executable of a real model's B-row decode bucket,
called back to back (each call waits for the previous one) with its inputs in four states:

  * fresh:   the batch metadata as numpy arrays (copied to the device by the call, at new addresses each time),
  * resident: the same batch already on the device, the same buffers every call,
  * caches reused: resident, and the caches are the same buffers every call (the executable donates them, so the
    output caches occupy the input caches' memory: addresses stay put either way).

Host time = time until the call returns (the launch, not the device's work). XLA runs the step as a CUDA graph;
if a launch must first update the graph because some input moved, the "fresh" launch costs more than "resident".

    PYTHONPATH=. python3 bench/lab/dispatch_probe.py --config bench/configs/nemotron_h_nano9b.json --batch 256
"""

import argparse
import json
import statistics
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--mamba-ssm-cache-dtype", default="bfloat16")
    args = parser.parse_args()

    import jaxmodels
    from jaxmodels.benchmark import random_model
    from jaxmodels.engine.batch import decode_batch
    from jaxmodels.step_context import StepKind

    with open(args.config) as f:
        raw = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    model = random_model(raw, "bfloat16")
    llm = jaxmodels.LLM(None, model=model, dtype="bfloat16", max_batch_size=args.batch, max_seq_len=512,
                        decode_sizes=[args.batch], prefill_sizes=[256], progress=False, warmup="all",
                        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    runner = llm.engine.runner
    forward = runner._executable((StepKind.DECODE, args.batch))
    batch, _ = decode_batch([], args.batch, runner.programs.example_tables)
    resident = jax.device_put(batch)

    def launch_times(make_batch) -> list[float]:
        times = []
        for _ in range(args.calls):
            b = make_batch()
            start = time.perf_counter()
            logits, runner.caches = forward(runner.params, runner.caches, runner.last_tokens, b)
            times.append(time.perf_counter() - start)
            jax.block_until_ready(logits)
        return times[3:]

    for name, make in (("fresh numpy batch", lambda: batch), ("resident batch", lambda: resident),
                       ("fresh device batch", lambda: jax.device_put(batch))):
        t = launch_times(make)
        print(f"{name:20s}: launch {statistics.median(t) * 1e3:.3f} ms (min {min(t) * 1e3:.3f}) "
              f"over {len(t)} calls; {len(runner.params)} param arrays, "
              f"{len(jax.tree.leaves(runner.caches))} cache arrays")


if __name__ == "__main__":
    main()
