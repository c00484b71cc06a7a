"""A model sharded on a ("dp", "tp") mesh of 8 simulated CPU devices gives the unsharded logits."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sharded_forward_equals_unsharded(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "tests.sharding.sharded_forward_check", str(tmp_path)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sharded forward matches" in result.stdout
