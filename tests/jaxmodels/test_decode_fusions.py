"""JAXMODELS_DECODE_FUSIONS=0 (jaxmodels.layers.decode_fusions) changes how a step computes, not what: the models'
logits with the fusions off equal those with them on (the default). On the CPU the fused norm is the XLA reference
(its kernel is tested in interpret mode in tests/pallas_kernels/test_add_rms_norm.py); the MoE routing by counting
runs as it would on the GPU."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodels.layers import decode_fusions
from jaxmodels.layers.moe import MoE
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


@pytest.mark.parametrize("model_type, shared", [("deepseek_v32", None), ("nemotron_h", 40)])
def test_logits_are_the_same_with_the_shared_expert_in_the_grouped_matmul(model_type, shared, monkeypatch):
    """JAXMODELS_SHARED_EXPERT_IN_GMM (on by default): a decode-sized step (one token a row) with the shared expert
    inside the routed experts' grouped matmuls gives the logits of the shared expert run beside them. The tiny
    DeepSeek's shared expert is one piece of the experts' size; the Nemotron-H one is given two (40 = 2 x 20)."""
    config = dict(TINY_CONFIGS[model_type])
    if shared:
        config["moe_shared_expert_intermediate_size"] = shared
    model = build_from_config(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 90, (3, 1)), jnp.int32)
    monkeypatch.setattr(decode_fusions, "SHARED_EXPERT_IN_GMM", False)
    beside = model(tokens)
    monkeypatch.setattr(decode_fusions, "SHARED_EXPERT_IN_GMM", True)
    moe_layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
    assert moe_layers and all(m.shared_rides_with_experts(3) for m in moe_layers)
    inside = model(tokens)
    assert rms_relative_error(np.asarray(inside), np.asarray(beside)) < 1e-5
