"""Nemotron-H config parsing: legacy and canonical field names agree; invalid values name their field."""

import math

import pytest

from jaxmodels.configs import ConfigError, NemotronHConfig
from jaxmodels.families import load_config

CANONICAL = {
    "model_type": "nemotron_h", "vocab_size": 100, "hidden_size": 32,
    "layers_block_type": ["mamba", "attention", "mlp", "moe"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
    "mamba_num_heads": 4, "mamba_head_dim": 10, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 3,
    "chunk_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16, "n_group": 2, "topk_group": 1,
}


def legacy_form(raw):
    legacy = dict(raw)
    legacy.pop("layers_block_type")
    legacy["hybrid_override_pattern"] = "M*-E"
    for new, old in (("n_groups", "mamba_n_groups"), ("conv_kernel", "mamba_d_conv"),
                     ("chunk_size", "mamba_chunk_size")):
        legacy[old] = legacy.pop(new)
    return legacy


def test_legacy_names_equal_canonical():
    canonical = load_config(CANONICAL)
    assert canonical.layer_types == ("mamba", "attention", "mlp", "moe")
    assert load_config(legacy_form(CANONICAL)) == canonical
    hf_names = {**CANONICAL, "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"]}
    assert load_config(hf_names) == canonical


def test_derived_sizes():
    config = load_config(CANONICAL)
    assert config.mamba_intermediate_size == 40
    assert config.conv_dim == 40 + 2 * 2 * 16


def test_infinite_time_step_limit_in_json(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "nemotron_h", "vocab_size": 10, "hidden_size": 8, "hybrid_override_pattern": "-",'
        ' "intermediate_size": 4, "num_attention_heads": 2, "time_step_limit": [0.0, {"__float__": "Infinity"}]}')
    assert isinstance(load_config(tmp_path), NemotronHConfig)


@pytest.mark.parametrize("change, field", [
    ({"layers_block_type": ["mamba", "transformer"]}, "layers_block_type"),
    ({"mamba_num_heads": 5}, "mamba_num_heads"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"n_routed_experts": 7}, "n_routed_experts"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"vocab_size": None}, "vocab_size"),
    ({"num_nextn_predict_layers": 1}, "mtp_layers_block_type"),  # MTP layers of no given kinds
    ({"num_nextn_predict_layers": 1, "mtp_layers_block_type": ["linear_attention", "moe"]}, "mtp_layers_block_type"),
    ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*X"}, "mtp_hybrid_override_pattern"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
])
def test_invalid_fields_are_named(change, field):
    with pytest.raises(ConfigError) as err:
        load_config({**CANONICAL, **change})
    assert err.value.field == field
    assert field in str(err.value)


def test_pattern_letter_error_lists_valid_letters():
    with pytest.raises(ConfigError, match=r"\['Q'\]"):
        load_config(legacy_form({**CANONICAL}) | {"hybrid_override_pattern": "MQ"})


def test_time_step_limit_defaults_to_no_clamp_and_reads_both_names():
    """transformers >= 5.25 (and NVIDIA's reference code) clamp dt at the config's `time_step_limit`, default
    (0, inf); `time_step_min` only initializes dt_bias."""
    assert load_config(CANONICAL).time_step_limit == (0.0, math.inf)
    assert load_config({**CANONICAL, "time_step_limit": [0.001, math.inf]}).time_step_limit == (0.001, math.inf)
    assert load_config(legacy_form(CANONICAL) | {"mamba_dt_limit": [0.01, 0.1]}).time_step_limit == (0.01, 0.1)


def test_mtp_pattern_equals_mtp_block_types():
    listed = load_config({**CANONICAL, "num_nextn_predict_layers": 1,
                          "mtp_layers_block_type": ["full_attention", "moe"]})
    assert listed.mtp_layer_types == ("attention", "moe")
    assert load_config({**CANONICAL, "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}) == listed


def test_mtp_block_types_without_mtp_layers_are_ignored():
    """transformers writes its default `mtp_layers_block_type` into every config, MTP layers or not."""
    config = load_config({**CANONICAL, "num_nextn_predict_layers": 0,
                          "mtp_layers_block_type": ["full_attention", "moe"]})
    assert config.mtp_layer_types == ()
