"""The floors' cost model: MTP layers apart from the target (read by drafting passes only), and the speculative
bound on hand-made costs whose bytes are counted here by hand."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.benchmark_floors import (
    ModelCosts, decode_step_bytes, draft_step_bytes, expected_tokens, model_costs, speculative_bound,
    verify_step_bytes)
from jaxmodels.families import abstract_model, load_config
from tests.hf_models import TINY_CONFIGS

TARGET_FIELDS = ("dense_weight_bytes", "expert_bytes", "moe_layers", "active_params_per_token", "head_params",
                 "cache_bytes_per_token", "state_bytes_per_request", "dsa_rows_bytes")


def abstract_params(raw: dict) -> tuple:
    """(config, {dotted path: ShapeDtypeStruct}) of `raw`'s model in bf16."""
    config = load_config(raw)
    return config, abstract_model(config, jnp.bfloat16)[2]


def nbytes(array) -> int:
    return int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize


@pytest.mark.parametrize("family, mtp", [("deepseek_v32", {}),
                                         ("nemotron_h", {"mtp_layers_block_type": ["attention", "moe"]})])
def test_mtp_layers_count_in_drafting_passes_only(family, mtp):
    """Adding an MTP layer leaves the target's costs as they were, and a drafting pass reads the MTP layer's
    weights but its routed experts, plus the LM head; its MoE layer's experts come in by routing, its attention
    layer's cache by context."""
    plain_config, plain = abstract_params(TINY_CONFIGS[family])
    config, params = abstract_params({**TINY_CONFIGS[family], "num_nextn_predict_layers": 1, **mtp})
    before, after = model_costs(plain_config, plain, "bfloat16"), model_costs(config, params, "bfloat16")
    assert {f: getattr(after, f) for f in TARGET_FIELDS} == {f: getattr(before, f) for f in TARGET_FIELDS}
    assert before.draft_weight_bytes == 0 and before.draft_moe_layers == 0
    mtp_params = {path: a for path, a in params.items() if path.startswith(("mtp.", "mtp_layers."))}
    assert mtp_params and set(params) - set(mtp_params) == set(plain)
    head = sum(nbytes(a) for path, a in params.items() if path.startswith("lm_head."))
    assert after.draft_weight_bytes == head + sum(nbytes(a) for p, a in mtp_params.items() if ".experts." not in p)
    assert after.draft_moe_layers == 1
    assert after.draft_cache_bytes_per_token > 0
    # A drafting pass of one request reads that, k experts, and its cache over the context.
    context = 10
    per_request = (after.draft_cache_bytes_per_token - after.draft_dsa_rows_bytes) * context \
        + after.draft_dsa_rows_bytes * min(context, after.index_topk or context)
    assert draft_step_bytes(after, 1, context) == pytest.approx(
        after.draft_weight_bytes + after.experts_per_token * after.expert_bytes + per_request)


HAND_MADE = ModelCosts(dense_weight_bytes=100.0, expert_bytes=10.0, moe_layers=1, num_experts=4, experts_per_token=1,
                       active_params_per_token=0.0, fp8_params_per_token=0.0, head_params=0.0,
                       cache_bytes_per_token=1.0, state_bytes_per_request=0.0, attention="gqa", attn_layers=1, heads=1,
                       head_flops_dim=1, draft_weight_bytes=20.0, draft_moe_layers=0)


def test_verify_step_reads_more_experts_but_each_cache_once():
    """One expert of 4 per token: one token reads 1 expert, two tokens 4 (1 - (3/4)^2) = 1.75 on average. Two
    requests at context 50 read 2 x 50 cache bytes, in a decode step and in a verify step alike."""
    assert decode_step_bytes(HAND_MADE, 2, 50) == pytest.approx(100 + 1.75 * 10 + 100)
    assert verify_step_bytes(HAND_MADE, 1, 1, 50) == pytest.approx(100 + 1.75 * 10 + 50)
    assert draft_step_bytes(HAND_MADE, 1, 50) == pytest.approx(20)


def test_speculative_bound_weighs_expected_tokens_against_a_cycles_bytes():
    """At context 0: a decode step moves 110 bytes, a verify step with one draft 117.5 and a drafting pass 20, so
    a cycle moves 137.5 for 1 + a tokens: 1.5 x 110 / 137.5 = 1.2 at a = 0.5, 110 / 137.5 = 0.8 when no draft
    stands."""
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert speculative_bound(HAND_MADE, 1, 1, 0.5, 0) == pytest.approx(1.2)
    assert speculative_bound(HAND_MADE, 1, 1, 0.0, 0) == pytest.approx(0.8)
    # Free drafts and a dense model: k + 1 tokens for the price of one step.
    dense = dataclasses.replace(HAND_MADE, moe_layers=0, draft_weight_bytes=0.0)
    assert speculative_bound(dense, 1, 3, 1.0, 0) == pytest.approx(4)
