"""Run in a subprocess with 8 simulated CPU devices: LLM with dp x tp > 1 serves the tokens of the 1-device LLM."""

import sys

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxmodels
from tests.hf_models import make_dsa, make_nemotron_h, save

LIMITS = dict(max_batch_size=4, max_seq_len=64, max_prefill_tokens=8, progress=False)


def serve(path, prompts, **mesh):
    llm = jaxmodels.LLM(path, dtype="float32", **LIMITS, **mesh)
    greedy = llm.generate(prompts, jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.0))
    sampled = llm.generate(prompts, jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3))
    return llm, [o.token_ids for o in greedy], [o.token_ids for o in sampled]


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (1, 6, 13, 27)]
    for name, hf_model, mesh in (("nemotron_h_moe", make_nemotron_h("moe"), dict(dp=2, tp=2)),
                                 ("deepseek_v32", make_dsa("deepseek_v32"), dict(dp=2, tp=4))):
        path = save(hf_model, f"{directory}/{name}")
        _, greedy_1, sampled_1 = serve(path, prompts)
        llm, greedy_n, sampled_n = serve(path, prompts, **mesh)
        assert greedy_n == greedy_1, (name, greedy_n, greedy_1)
        assert sampled_n == sampled_1, (name, sampled_n, sampled_1)
        devices = {len(a.sharding.device_set) for a in jax.tree.leaves(llm.engine.runner.caches)}
        assert devices == {mesh["dp"] * mesh["tp"]}, devices
        if name.startswith("nemotron"):
            kv = next(cache for cache in llm.engine.runner.caches if hasattr(cache, "k"))
            assert kv.k.sharding.spec == P(None, None, "tp", None)
        print(f"{name}: dp={mesh['dp']} tp={mesh['tp']} serves the 1-device tokens")


if __name__ == "__main__":
    main(sys.argv[1])
