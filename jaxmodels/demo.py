"""The demo: a small random Nemotron-H checkpoint written on the spot, loaded through the bridge, served.

It needs no torch and no download: the checkpoint is built from a random model with safetensors.
"""

import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

DEMO_CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 512,
    "hidden_size": 256,
    "hybrid_override_pattern": "M-M*ME-M",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 512,
    "mamba_num_heads": 8,
    "mamba_head_dim": 48,
    "ssm_state_size": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "moe_shared_expert_intermediate_size": 256,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "layer_norm_epsilon": 1e-5,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}


def write_demo_checkpoint(directory, seed: int = 0) -> str:
    """Write a random Nemotron-H checkpoint (HF layout) of DEMO_CONFIG's shape into `directory`."""
    from bridge.export import save_hf_checkpoint
    from jaxmodels.families import load_config
    from jaxmodels.models.nemotron_h import NemotronHForCausalLM
    from jaxmodels.nnx_params import model_params

    model = NemotronHForCausalLM(load_config(DEMO_CONFIG), rngs=nnx.Rngs(seed))
    return save_hf_checkpoint(model_params(model), DEMO_CONFIG, directory,
                              base_prefix=NemotronHForCausalLM.HF_BASE_PREFIX)


def run_demo(num_requests: int = 8, max_new_tokens: int = 32, seed: int = 0) -> None:
    from jaxmodels.llm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_checkpoint(os.path.join(tmp, "demo-nemotron-h"), seed)
        print(f"wrote a random Nemotron-H checkpoint ({DEMO_CONFIG['hybrid_override_pattern']}) to {path}")
        # Few buckets keep the warm-up short on a 2-core CPU: 64-token prefill steps (one smaller bucket for
        # tails), decode batches of 1, 4 and 8.
        llm = LLM(path, dtype="float32", max_batch_size=8, max_seq_len=128, prefill_sizes=[16, 64],
                  decode_sizes=[1, 4, 8])
    # The engine has logged "ready to serve" with the buckets compiled; the others compile in the background.
    llm.wait_until_compiled()  # so that the throughput below is the engine's, not shared with compilation
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, DEMO_CONFIG["vocab_size"], size=int(n)).tolist()
               for n in rng.integers(4, 40, size=num_requests)]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"prompt of {len(prompt):2d} tokens -> {out.token_ids[:12]}... ({out.finish_reason})")
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
          f"({num_requests} requests, LLM.generate with paged KV and Mamba state caches, {jax.default_backend()})")
