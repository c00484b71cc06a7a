"""JAXMODELS_DECODE_FUSIONS=0 (jaxmodels.layers.decode_fusions) changes how a step computes, not what: the models'
logits with the fusions off equal those with them on (the default). On the CPU the fused norm is the XLA reference
(its kernel is tested in interpret mode in tests/pallas_kernels/test_add_rms_norm.py); the MoE routing by counting
runs as it would on the GPU."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import decode_fusions
from tests.hf_models import TINY_CONFIGS, build_from_config
from tests.numerics import rms_relative_error


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_logits_are_the_same_with_the_fusions_on(model_type, monkeypatch):
    model = build_from_config(TINY_CONFIGS[model_type])
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 90, (2, 11)), jnp.int32)
    monkeypatch.setattr(decode_fusions, "ENABLED", False)
    off = model(tokens)
    monkeypatch.setattr(decode_fusions, "ENABLED", True)
    on = model(tokens)
    # float32: only the order of the k-term sums over experts differs.
    assert rms_relative_error(np.asarray(on), np.asarray(off)) < 1e-5
