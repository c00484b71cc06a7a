"""The serving benchmark's one tiny CPU run, shared by the tests of its phases (test_benchmark.py) and of its report
(test_benchmark_report.py): every phase, transformers beside it, two samplings, two prefill lengths, JSON and
figures. Its tests are all `slow`, so they run next to each other (tests/conftest.py) on one worker."""

import contextlib
import io
import json

import pytest

from jaxmodels.__main__ import main

TINY = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 256, "hidden_size": 64,
    "hybrid_override_pattern": "M*ME-", "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
    "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "n_group": 2, "topk_group": 1,
}

BENCH_ARGS = ["--layers", "4", "--batches", "1,4", "--prompt-len", "12", "--decode-steps", "6", "--prefill-len",
              "16,40", "--prefill-chunk", "32", "--serve", "4", "--serve-in", "10", "--serve-out", "5",
              "--arrival-rate", "50", "--dtype", "float32", "--compare-transformers", "--torch-device", "cpu",
              "--no-progress", "--sampling", "plain,penalties"]


@pytest.fixture(scope="session")
def bench_run(tmp_path_factory):
    """(results JSON path, figures directory, the JSON's data, what the run printed)."""
    directory = tmp_path_factory.mktemp("bench")
    config = directory / "config.json"
    config.write_text(json.dumps(TINY))
    results, figures = directory / "results.json", directory / "figures"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["bench", "--config", str(config), *BENCH_ARGS, "--json", str(results), "--plot", str(figures)])
    return results, figures, json.loads(results.read_text()), printed.getvalue()
