"""Run in a subprocess with 8 simulated CPU devices: speculative decoding composes with DP attention. On a
(dp=2, tp=2) mesh, an LLM drafting 2 tokens per step with the MTP layer serves the greedy and sampled tokens of the
1-device speculative LLM, and the greedy ones equal plain greedy decoding (a Nemotron-H MoE checkpoint whose drafts
often agree: tests/hf_mtp.save_with_drafting_mtp). Four prompts on two groups; nothing compiles after warm-up."""

import sys

import jax

from tests.engine.test_llm import greedy_by_full_forward, random_prompts
from tests.hf_mtp import save_with_drafting_mtp
from tests.sharding.sharded_serving_check import serve

SPECULATIVE = 2


def main(directory: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    prompts = random_prompts((1, 6, 13, 27))
    save_with_drafting_mtp("nemotron_h_moe", directory, target_scale=0.1)
    llm_1, greedy_1, sampled_1 = serve(directory, prompts, num_speculative_tokens=SPECULATIVE)
    assert greedy_1 == greedy_by_full_forward(llm_1.model, prompts, 8)
    assert 0 < llm_1.metrics()["spec_accept_rate"] < 1
    del llm_1
    llm, greedy_n, sampled_n = serve(directory, prompts, dp=2, tp=2, num_speculative_tokens=SPECULATIVE)
    assert greedy_n == greedy_1, (greedy_n, greedy_1)
    assert sampled_n == sampled_1, (sampled_n, sampled_1)
    print("dp=2 tp=2 with speculative decoding serves the 1-device tokens")


if __name__ == "__main__":
    main(sys.argv[1])
