"""Shared pytest set-up: float32 matmuls at full precision and the `gpu` marker that skips on CPU machines."""

import jax
import pytest

# Parity tests compare against torch in float32; XLA's default CPU matmul precision is already exact, but set it
# explicitly so a GPU run of the same tests does not silently use TF32.
jax.config.update("jax_default_matmul_precision", "highest")


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
