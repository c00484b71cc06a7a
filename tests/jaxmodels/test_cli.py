"""The command line: `generate` on a checkpoint and the no-argument demo, as a user runs them."""

import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

import jaxmodels
from tests.hf_models import make_nemotron_h, save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli_process(*args) -> subprocess.CompletedProcess:
    """`python -m jaxmodels *args`, which must succeed; its stdout and stderr (the log) as text."""
    result = subprocess.run([sys.executable, "-m", "jaxmodels", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_cli(*args) -> str:
    return run_cli_process(*args).stdout


def test_generate_prints_the_engine_tokens(tmp_path):
    path = save(make_nemotron_h("dense"), tmp_path)
    out = run_cli("generate", "--model", str(path), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "5",
                  "--dtype", "float32", "--max-seq-len", "64")
    llm = jaxmodels.LLM(path, dtype="float32", max_batch_size=1, max_seq_len=64, warmup=False, progress=False)
    (expected,) = llm.generate([[5, 6, 7, 8]], jaxmodels.SamplingParams(max_new_tokens=5, temperature=0.0))
    assert str(expected.token_ids) in out
    assert f"[5 tokens, finish_reason={expected.finish_reason}]" in out


def test_generate_passes_the_ssm_state_dtype(tmp_path):
    """--mamba-ssm-cache-dtype bfloat16 reaches the engine: its pool log names a bf16 state (the config's is
    float32), and the tokens are those of LLM(..., mamba_ssm_cache_dtype="bfloat16")."""
    path = save(make_nemotron_h("dense"), tmp_path)
    result = run_cli_process("generate", "--model", str(path), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "5",
                             "--dtype", "float32", "--max-seq-len", "64", "--mamba-ssm-cache-dtype", "bfloat16")
    pools = [line for line in result.stderr.splitlines() if line.startswith("cache pools:")]
    assert pools and "ssm" in pools[0] and all("float32" not in part for part in pools[0].split(";")
                                               if part.strip().startswith("ssm")), pools
    llm = jaxmodels.LLM(path, dtype="float32", max_batch_size=1, max_seq_len=64, warmup=False, progress=False,
                        mamba_ssm_cache_dtype="bfloat16")
    assert llm.engine.runner.caches[0].ssm.dtype == jnp.bfloat16
    (expected,) = llm.generate([[5, 6, 7, 8]], jaxmodels.SamplingParams(max_new_tokens=5, temperature=0.0))
    assert str(expected.token_ids) in result.stdout


def test_generate_rejects_a_bad_prompt(tmp_path):
    path = save(make_nemotron_h("dense"), tmp_path)
    result = subprocess.run([sys.executable, "-m", "jaxmodels", "generate", "--model", str(path), "--prompt-ids",
                             "5,1000", "--dtype", "float32", "--max-seq-len", "64"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode != 0
    assert "1000" in result.stderr and "vocab" in result.stderr


@pytest.mark.slow
def test_demo_runs_and_reports_throughput():
    out = run_cli("demo", "--requests", "3", "--max-new-tokens", "6")
    assert "wrote a random Nemotron-H checkpoint" in out
    assert "tokens/s" in out
