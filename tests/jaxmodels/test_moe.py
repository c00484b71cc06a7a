"""Routed experts: ranking the (token, expert) pairs by counting gives what sorting them gives."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodels.layers import decode_fusions
from jaxmodels.layers.moe import RoutedExperts, expert_ranks, sort_by_expert
from tests.numerics import rms_relative_error


@pytest.mark.parametrize("pairs, groups", [(1, 3), (12, 5), (64, 9)])
def test_ranks_invert_the_stable_sort(pairs, groups):
    experts = jnp.asarray(np.random.default_rng(pairs).integers(0, groups, (pairs,)), jnp.int32)
    order, sizes = sort_by_expert(experts, groups)
    rank, counted = expert_ranks(experts, groups)
    assert np.array_equal(np.asarray(rank)[np.asarray(order)], np.arange(pairs))
    assert np.array_equal(np.asarray(counted), np.asarray(sizes))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("tokens, first_expert", [(1, 0), (7, 0), (7, 3)])
def test_counting_path_equals_the_sorting_path(monkeypatch, gated, tokens, first_expert):
    """Same experts, same rows, float32: only the order of the k-term sums differs. first_expert 3 holds experts
    3..8 of 12 (a dp group's slice): the other choices contribute nothing on either path."""
    rng = np.random.default_rng(tokens + first_expert)
    experts_module = RoutedExperts(6 if first_expert else 12, 16, 24, rngs=nnx.Rngs(0), gated=gated,
                                   activation="silu" if gated else "relu2")
    experts_module.num_experts = 12
    x = jnp.asarray(rng.standard_normal((tokens, 16)), jnp.float32)
    choice = jnp.asarray(np.stack([rng.choice(12, 4, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 4)), jnp.float32)
    monkeypatch.setattr(decode_fusions, "ENABLED", True)
    counted = experts_module(x, weights, choice, first_expert)
    monkeypatch.setattr(decode_fusions, "ENABLED", False)
    sorted_ = experts_module(x, weights, choice, first_expert)
    assert rms_relative_error(counted, sorted_) < 1e-6
    # The held experts' contribution is there (not all zero) on both.
    assert float(jnp.abs(sorted_).max()) > 0
