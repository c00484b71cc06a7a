"""DSA checkpoints (DeepSeek-V3.2, GLM-5) that do not fit the model, or bad config fields, fail naming what is wrong;
the MTP layers stored after the last decoder layer are loaded, and nothing beyond them."""

import json

import numpy as np
import pytest

import jaxmodels
from bridge import CheckpointError
from jaxmodels import ConfigError
from tests.bridge.test_loading_errors import edited_copy
from tests.hf_models import make_dsa, save


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    return save(make_dsa("deepseek_v32"), tmp_path_factory.mktemp("dsa"))


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory):
    return save(make_dsa("glm_moe_dsa"), tmp_path_factory.mktemp("glm"))


def test_missing_indexer_tensor_is_named(good_checkpoint, tmp_path):
    name = "model.layers.2.self_attn.indexer.wk.weight"
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing(.|\n)*layers\.2\.self_attn\.indexer\.wk\.weight"):
        jaxmodels.load_model(path, progress=False)


def test_missing_expert_is_named(good_checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.6.gate_proj.weight"
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.6\.gate_proj\.weight"):
        jaxmodels.load_model(path, progress=False)


def test_wrong_latent_shape_names_tensor_and_both_shapes(good_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [H * (nope + v), kv_lora_rank] = [88, 20]

    def shrink(tensors):
        tensors[name] = tensors[name][:, :-1]

    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=shrink)
    with pytest.raises(CheckpointError) as err:
        jaxmodels.load_model(path, progress=False)
    message = str(err.value)
    assert "layers.0.self_attn.kv_b_proj.weight" in message
    assert "(88, 19)" in message and "(88, 20)" in message


def test_indexer_on_a_shared_glm_layer_is_unexpected(glm_checkpoint, tmp_path):
    """GLM-5's layer 2 is `shared`: it has no indexer, so indexer weights there are a mismatch, not silently unused."""
    def add(tensors):
        tensors["model.layers.2.self_attn.indexer.wk.weight"] = tensors["model.layers.1.self_attn.indexer.wk.weight"]

    path = edited_copy(glm_checkpoint, tmp_path / "ckpt", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*layers\.2\.self_attn\.indexer\.wk\.weight"):
        jaxmodels.load_model(path, progress=False)


def test_mtp_layer_is_loaded_but_nothing_beyond(good_checkpoint, tmp_path):
    """num_nextn_predict_layers = 1 and 3 decoder layers: `layers.3.*` is the MTP layer; `layers.4.*` is junk."""
    def declare_mtp(config):
        config["num_nextn_predict_layers"] = 1

    def add_mtp(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("layers.2.", "layers.3.")] = tensors[name]
        tensors["model.layers.3.enorm.weight"] = np.ones((48,), np.float32)
        tensors["model.layers.3.hnorm.weight"] = np.ones((48,), np.float32)
        tensors["model.layers.3.eh_proj.weight"] = np.zeros((48, 96), np.float32)
        tensors["model.layers.3.shared_head.norm.weight"] = np.ones((48,), np.float32)

    path = edited_copy(good_checkpoint, tmp_path / "mtp", edit_tensors=add_mtp, edit_config=declare_mtp)
    model = jaxmodels.load_model(path, progress=False)
    assert (len(model.layers), len(model.mtp_layers)) == (3, 1)

    def add_junk(tensors):
        add_mtp(tensors)
        tensors["model.layers.4.input_layernorm.weight"] = np.ones((48,), np.float32)

    path = edited_copy(good_checkpoint, tmp_path / "junk", edit_tensors=add_junk, edit_config=declare_mtp)
    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*layers\.4\.input_layernorm\.weight"):
        jaxmodels.load_model(path, progress=False)


@pytest.mark.parametrize("edit, field", [
    (dict(n_routed_experts=6), "n_routed_experts"),  # 6 experts in 4 groups
    (dict(topk_group=5), "topk_group"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),  # 2 of 4 groups of 2 experts hold only 4
    (dict(index_head_dim=4), "index_head_dim"),  # fewer channels than the 8 rope channels it rotates
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_layer_types=["dense", "sparse"]), "mlp_layer_types"),  # 2 entries for 3 layers
    (dict(mlp_layer_types=["dense", "moe", "sparse"]), "mlp_layer_types"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_parameters.rope_type"),
    (dict(indexer_numerics="fp4"), "indexer_numerics"),
    (dict(indexer_numerics="reference", index_head_dim=24), "index_head_dim"),  # Hadamard needs a power of two
])
def test_bad_config_field_is_named(good_checkpoint, tmp_path, edit, field):
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_config=lambda c: c.update(edit))
    with pytest.raises(ConfigError) as err:
        jaxmodels.load_model(path, progress=False)
    assert err.value.field == field
    assert field in str(err.value)


@pytest.mark.parametrize("edit, field", [
    (dict(indexer_types=["shared", "full", "full"]), "indexer_types"),  # nothing to share from
    (dict(indexer_types=["full", "sparse", "full"]), "indexer_types"),
])
def test_bad_glm_indexer_types(glm_checkpoint, tmp_path, edit, field):
    path = edited_copy(glm_checkpoint, tmp_path / "ckpt", edit_config=lambda c: c.update(edit))
    with pytest.raises(ConfigError, match=field):
        jaxmodels.load_model(path, progress=False)


def test_legacy_rope_scaling_is_read(good_checkpoint, tmp_path):
    """DeepSeek's own config.json spells YaRN as top-level `rope_theta` + `rope_scaling` with `type`."""
    from jaxmodels.families import load_config

    def legacy(config):
        config.pop("rope_parameters")
        config["rope_theta"] = 5e4
        config["rope_scaling"] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_config=legacy)
    rope = load_config(path).rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.mscale_all_dim) == ("yarn", 5e4, 40.0, 1.0)
    with open(path / "config.json") as f:
        assert "rope_parameters" not in json.load(f)
