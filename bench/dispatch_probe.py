"""Where the host time of a decode step's launch goes, on a real model's B-row decode bucket: the engine's launch
(the forward executable, then the sampler) called as the engine calls it, each launch followed by reading the step
before it (so the device is busy with step N while step N+1 is sent), with the step's inputs sent four ways:

  * numpy:     the batch and sampling knobs as numpy arrays, as the engine sends them (one host-to-device copy per
               array, each landing at a new address),
  * resident:  the same batch and knobs already on the device, the same buffers every call (no copy, no move),
  * packed:    one int32 buffer for batch and knobs (jaxmodels/engine/transfer.py), one copy, read in place,
  * staged:    packed, and copied first thing in the program into the executable's temporary memory, which every
               other kernel reads (its address stays put from step to step).

Host time = time until the launch returns (not the device's work); median over the calls after three.

    PYTHONPATH=. python3 bench/dispatch_probe.py --config bench/configs/nemotron_h_nano9b.json --batch 256
"""

import argparse
import json
import statistics
import time

import jax
import numpy as np


def overlapped_launch_times(launch, calls: int) -> list[float]:
    """Launch `calls` steps, reading each step's tokens after the next is sent; -> each launch's host seconds."""
    times, pending = [], None
    for _ in range(calls):
        start = time.perf_counter()
        tokens = launch()
        times.append(time.perf_counter() - start)
        if pending is not None:
            np.asarray(pending)
        pending = tokens
    np.asarray(pending)
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--mamba-ssm-cache-dtype", default=None, help="default: the config's (float32)")
    args = parser.parse_args()

    import jaxmodels
    from jaxmodels.benchmark import random_model
    from jaxmodels.engine.batch import decode_batch
    from jaxmodels.engine.runner import _forward_fn, _sampler_fn
    from jaxmodels.engine.transfer import pack_groups
    from jaxmodels.step_context import StepKind

    with open(args.config) as f:
        raw = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    model = random_model(raw, "bfloat16")
    llm = jaxmodels.LLM(None, model=model, dtype="bfloat16", max_batch_size=args.batch, max_seq_len=512,
                        decode_sizes=[args.batch], prefill_sizes=[256], progress=False,
                        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    runner = llm.engine.runner
    tables = runner._example_tables
    kind = StepKind.DECODE

    def numpy_launch():
        return runner._run(kind, args.batch, *decode_batch([], args.batch, tables))

    resident = jax.device_put(decode_batch([], args.batch, tables))

    def resident_launch():
        return runner._run(kind, args.batch, *resident)

    forward = _forward_fn(runner.step, kind, runner.param_names, None)
    sampler = _sampler_fn("greedy")
    packed_forward = jax.jit(lambda p, c, last, packed: forward(p, c, last, packed.unpack()[0]), donate_argnums=(1,))
    packed_sampler = jax.jit(lambda logits, last, packed: sampler(logits, last, packed.unpack()[1]),
                             donate_argnums=(1,))

    def packed_launch(stage: bool):
        def launch():
            packed = jax.device_put(pack_groups([decode_batch([], args.batch, tables)], stage=stage))
            logits, runner.caches = packed_forward(runner.params, runner.caches, runner.last_tokens, packed)
            tokens, runner.last_tokens = packed_sampler(logits, runner.last_tokens, packed)
            return tokens
        return launch

    print(f"B={args.batch}: {len(runner.params)} param arrays, {len(jax.tree.leaves(runner.caches))} cache arrays")
    for name, launch in (("numpy (the engine)", numpy_launch), ("resident", resident_launch),
                         ("packed", packed_launch(False)), ("staged", packed_launch(True)),
                         ("numpy again", numpy_launch)):
        times = overlapped_launch_times(launch, args.calls)
        print(f"B={args.batch} {name:20s}: launch {statistics.median(times) * 1e3:.3f} ms "
              f"(min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f}) over {len(times)} calls")


if __name__ == "__main__":
    main()
