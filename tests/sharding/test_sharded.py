"""Sharded on a ("dp", "tp") mesh of 8 simulated CPU devices (2 for the bf16 check), the model and the engine give
the 1-device results.

Each check runs in a subprocess: the simulated device count must be set before jax starts.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from tests.cpu_devices import ROOT, cpu_devices_flags, run_on_devices
from tests.sharding.sharded_serving_check import MESHES

pytestmark = pytest.mark.slow  # each starts processes that compile engines for several meshes

def test_sharded_forward_equals_unsharded(tmp_path):
    assert "sharded forward matches" in run_on_devices("tests.sharding.sharded_forward_check", tmp_path)


def test_sharded_serving_equals_one_device(tmp_path):
    out = run_on_devices("tests.sharding.sharded_serving_check", tmp_path)
    for model in ("nemotron_h_moe", "deepseek_v32"):
        for dp, tp in MESHES:
            assert f"{model}: dp={dp} tp={tp} serves the 1-device tokens" in out


def test_speculative_serving_on_a_mesh_equals_one_device(tmp_path):
    out = run_on_devices("tests.sharding.speculative_serving_check", tmp_path)
    assert "dp=2 tp=2 with speculative decoding serves the 1-device tokens" in out


def test_sharded_fp8_serving_follows_one_device(tmp_path):
    """FP8 weights split over the mesh with their scales (tests/sharding/fp8_serving_check.py)."""
    out = run_on_devices("tests.sharding.fp8_serving_check", tmp_path)
    for model in ("deepseek_v32", "nemotron_h"):
        assert f"{model}: dp=2 tp=2 serves the FP8 checkpoint as one device does" in out


def test_bf16_groups_on_the_cpu(tmp_path):
    """A bf16 model at dp=2 on simulated CPU devices (tests/sharding/bf16_groups_check.py): XLA's CPU compiler
    aborted the process on its reduce-scatter."""
    out = run_on_devices("tests.sharding.bf16_groups_check", tmp_path, devices=2)
    assert "bf16 sum over groups within its rounding" in out and "bf16 dp=2 serves" in out


def test_multi_process_job_equals_one_device(tmp_path):
    """Two processes of one JAX job on this host, as two hosts would run it (tests/sharding/multihost_check.py): the
    mesh spans both; LLM.generate on every process, on process 0 alone, and the HTTP server on process 0 serve the
    1-device tokens of both families."""
    from tests.hf_models import make_dsa, make_nemotron_h, save

    families = {"deepseek_v32": make_dsa("deepseek_v32"), "nemotron_h_moe": make_nemotron_h("moe")}
    for name, model in families.items():
        save(model, tmp_path / name)
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=cpu_devices_flags(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2")
    processes = [subprocess.Popen([sys.executable, "-m", "tests.sharding.multihost_check", str(tmp_path)], cwd=ROOT,
                                  env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    for process, out in zip(processes, outputs):
        assert process.returncode == 0, out[-3000:]
    for name in families:
        for check in ("every process's generate serves the 1-device tokens",
                      "generate on process 0 alone, process 1 following, serves them",
                      "the server on process 0 answers them"):
            assert f"{name}: {check}" in outputs[0]
        steps = [re.search(rf"{name}: process {i} ran (\d+) steps", out).group(1) for i, out in enumerate(outputs)]
        assert steps[0] == steps[1], (name, steps)  # process 1 ran every step process 0 did, no more
