"""Sharded on a ("dp", "tp") mesh of 8 simulated CPU devices, the model and the engine give the 1-device results.

Each check runs in a subprocess: the simulated device count must be set before jax starts.
"""

import os
import subprocess
import sys

from tests.sharding.sharded_serving_check import MESHES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_on_8_devices(module: str, directory) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", module, str(directory)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_sharded_forward_equals_unsharded(tmp_path):
    assert "sharded forward matches" in run_on_8_devices("tests.sharding.sharded_forward_check", tmp_path)


def test_sharded_serving_equals_one_device(tmp_path):
    out = run_on_8_devices("tests.sharding.sharded_serving_check", tmp_path)
    for model in ("nemotron_h_moe", "deepseek_v32"):
        for dp, tp in MESHES:
            assert f"{model}: dp={dp} tp={tp} serves the 1-device tokens" in out
