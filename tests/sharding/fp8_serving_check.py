"""Run in a subprocess with 8 simulated CPU devices: LLM on a (2, 2) mesh serves an FP8 checkpoint as the 1-device
LLM does.

The FP8 weights split over the mesh with their scales: DeepSeek-V3.2's dense MLP (512 wide: four 128-blocks, one per
device) and its experts, Nemotron-H's experts with their per-expert scales. Inside the step, each dp group multiplies
by its own slices of weights and scales (a scale that did not split with its weight would not fit it there), and the
down projections sum partial products across devices, in another order than one device does: FP8 rounding may then
move a logit by as much as FP8 rounding moves it from the dense model's, and greedy tokens may part at ties: where
they part, the 1-device model's top two logits must tie (tests/fp8_bounds.py).
"""

import sys

import jax
import numpy as np

import jaxmodels
from tests.fp8_bounds import is_tie
from tests.hf_fp8 import make_fp8_case

# Two rows per dp group. Greedy requests only: warm-up "all" compiles the one bucket of each kind and leaves the
# samplers of sampled requests uncompiled (the default warm-up compiles them in the background, for nothing here).
LIMITS = dict(max_seq_len=48, prefill_sizes=[8], decode_sizes=[2], warmup="all", progress=False)
CASES = {"deepseek_v32": dict(intermediate_size=512, n_routed_experts=4, num_experts_per_tok=4), "nemotron_h": {}}


def greedy(llm, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.0))]


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    for name, overrides in CASES.items():
        vocab = 97 if name == "nemotron_h" else 101
        prompts = [rng.integers(3, vocab, size=n).tolist() for n in (5, 13)]
        fp8 = make_fp8_case(name, f"{directory}/{name}", calibration_ids=[np.array([p]) for p in prompts],
                            **overrides)
        one = jaxmodels.LLM(fp8.fp8_dir, dtype="float32", max_batch_size=2, **LIMITS)
        expected, model = greedy(one, prompts), one.model
        sharded = jaxmodels.LLM(fp8.fp8_dir, dtype="float32", dp=2, tp=2, max_batch_size=4, **LIMITS)
        runner = sharded.engine.runner
        params = dict(zip(runner.param_names, runner.params))
        split = [path for path, value in params.items()
                 if value.dtype == jax.numpy.float8_e4m3fn and not value.sharding.is_fully_replicated]
        assert split, "no FP8 weight is split over the mesh"
        for prompt, got, want in zip(prompts, greedy(sharded, prompts), expected):
            parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            if parted is not None:
                logits = np.asarray(model(np.array([prompt + want[:parted]])))[0, -1]
                assert is_tie(logits, model), (name, prompt, parted)
        print(f"{name}: dp=2 tp=2 serves the FP8 checkpoint as one device does ({len(split)} FP8 weights split)")


if __name__ == "__main__":
    main(sys.argv[1])
