"""Checks run in a subprocess with simulated CPU devices: their count must be set before jax starts."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` simulated CPU devices, keeping this process's flags (conftest's)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def run_on_devices(module: str, *args, devices: int = 8) -> str:
    """`python -m module *args` with `devices` simulated CPU devices; its stdout, after asserting it succeeded."""
    env = dict(os.environ, XLA_FLAGS=cpu_devices_flags(devices), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
