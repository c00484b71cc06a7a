"""The serving benchmark runs end to end on CPU with a tiny config (its numbers mean nothing here: the GPU run does),
transformers comparator included, and reports every phase."""

import json

from jaxmodels.__main__ import main

TINY = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64,
    "hybrid_override_pattern": "M*ME-", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
    "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_group": 2, "topk_group": 1,
}


def test_benchmark_reports_every_phase(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    results = tmp_path / "results.json"
    main(["bench", "--config", str(config), "--layers", "4", "--batches", "1,4", "--prompt-len", "12",
          "--decode-steps", "6", "--prefill-len", "40", "--prefill-chunk", "32", "--serve", "4", "--serve-in", "10",
          "--serve-out", "5", "--arrival-rate", "50", "--dtype", "float32", "--compare-transformers",
          "--torch-device", "cpu", "--no-progress", "--json", str(results)])
    out = capsys.readouterr().out
    data = json.loads(results.read_text())
    assert [row["batch"] for row in data["decode"]] == [1, 4]
    assert all(row["step_ms"] > 0 and 0 < row["host_share"] <= 1 for row in data["decode"])
    assert data["prefill"]["tokens"] == 40
    assert [row["rate"] for row in data["serve"]] == [0.0, 50.0]
    assert data["serve"][0]["out_tok_s"] > 0
    assert [row["batch"] for row in data["transformers"]["decode"]] == [1, 4]
    assert "### serving run" in out
    assert out.strip().splitlines()[-1].startswith("headline: decode B=4")


def test_profile_covers_only_the_measured_phases(tmp_path, capsys):
    """Without the prefill phase the engine is not sized for the (default 4096-token) prefill prompt, so the
    profile must not run it; the results JSON is written before profiling."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    results = tmp_path / "results.json"
    main(["bench", "--config", str(config), "--layers", "2", "--phases", "decode", "--batches", "2",
          "--prompt-len", "8", "--decode-steps", "4", "--dtype", "float32", "--no-progress",
          "--json", str(results), "--profile", str(tmp_path / "traces")])
    out = capsys.readouterr().out
    assert json.loads(results.read_text())["decode"][0]["batch"] == 2
    assert "## profile: decode B=2" in out
    assert "## profile: prefill" not in out
