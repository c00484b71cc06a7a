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


def _moe(gated: bool, shared_intermediate: int):
    from jaxmodels.layers.moe import MoE
    from jaxmodels.layers.mlp import GatedMLP, MLP

    activation = "silu" if gated else "relu2"
    shared = (GatedMLP if gated else MLP)(16, shared_intermediate, rngs=nnx.Rngs(1), activation=activation)
    return MoE(16, num_experts=12, top_k=4, expert_intermediate=8, shared_intermediate=shared_intermediate,
               n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rngs=nnx.Rngs(0),
               activation=activation, gated=gated, shared_expert=shared)


@pytest.mark.parametrize("gated, shared_intermediate", [(False, 16), (True, 8), (False, 24)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_shared_expert_in_the_grouped_matmul_equals_it_beside(monkeypatch, gated, shared_intermediate, tokens):
    """JAXMODELS_SHARED_EXPERT_IN_GMM: the shared expert cut into experts of the routed ones' size (2, 1 and 3
    pieces here) and run in their grouped matmuls gives the layer's output with it run on its own. float32: only the
    order of the sum over the experts and the shared expert differs."""
    moe = _moe(gated, shared_intermediate)
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, 16)), jnp.float32)
    beside = moe(x)
    monkeypatch.setattr(decode_fusions, "SHARED_EXPERT_IN_GMM", True)
    assert moe.shared_rides_with_experts(tokens)
    inside = moe(x)
    assert rms_relative_error(inside, beside) < 1e-6
    # The shared expert's part is there: without it the output differs.
    assert rms_relative_error(moe.routed(x), beside) > 1e-2


def test_shared_expert_rides_only_where_it_fits(monkeypatch):
    from jaxmodels.layers.moe import SHARED_IN_GROUPED_MAX_ROWS

    monkeypatch.setattr(decode_fusions, "SHARED_EXPERT_IN_GMM", True)
    # 16 = two pieces of the experts' 8: up to SHARED_IN_GROUPED_MAX_ROWS / 2 tokens, its own GEMMs beyond
    assert _moe(False, 16).shared_rides_with_experts(SHARED_IN_GROUPED_MAX_ROWS // 2)
    assert not _moe(False, 16).shared_rides_with_experts(SHARED_IN_GROUPED_MAX_ROWS // 2 + 1)
    assert _moe(True, 8).shared_rides_with_experts(SHARED_IN_GROUPED_MAX_ROWS)  # one piece
    assert not _moe(False, 12).shared_rides_with_experts(3)  # not a multiple of the experts' 8
    monkeypatch.setattr(decode_fusions, "ENABLED", False)
    assert not _moe(False, 16).shared_rides_with_experts(3)
    monkeypatch.setattr(decode_fusions, "ENABLED", True)
    monkeypatch.setattr(decode_fusions, "SHARED_EXPERT_IN_GMM", False)
    assert not _moe(False, 16).shared_rides_with_experts(3)
