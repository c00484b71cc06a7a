"""The engine benchmark runs end to end on CPU with a tiny config (its numbers mean nothing here: the GPU run does)."""

import json

from jaxmodels.__main__ import main

TINY = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64,
    "hybrid_override_pattern": "M*ME-", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
    "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_group": 2, "topk_group": 1,
}


def test_benchmark_runs_and_our_tokens_agree(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    main(["bench", "--config", str(config), "--layers", "4", "--batch", "3", "--prompt-len", "20", "--new-tokens",
                "8", "--dtype", "float32", "--device", "cpu", "--prefill-chunk", "32"])
    out = capsys.readouterr().out
    assert "first 8 greedy tokens equal to transformers': 100% of positions" in out
    assert out.strip().splitlines()[-1].startswith("headline: jaxmodels")
