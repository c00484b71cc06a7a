"""A checkpoint that does not fit the model, or a bad config, fails with an error naming what is wrong."""

import json
import os
import shutil

import pytest
from safetensors.numpy import load_file, save_file

import jaxmodels
from bridge import CheckpointError
from jaxmodels import ConfigError
from tests.hf_models import make_nemotron_h, save


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    return save(make_nemotron_h("moe"), tmp_path_factory.mktemp("good"))


def edited_copy(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit_tensors(tensors)
        save_file(tensors, path)
    if edit_config:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f)
    return dst


def test_missing_tensor_is_named(good_checkpoint, tmp_path):
    name = "backbone.layers.0.mixer.A_log"
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing(.|\n)*layers\.0\.mixer\.A_log"):
        jaxmodels.load_model(path, progress=False)


def test_missing_expert_is_named(good_checkpoint, tmp_path):
    name = "backbone.layers.1.mixer.experts.5.down_proj.weight"
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mixer\.experts\.5\.down_proj\.weight"):
        jaxmodels.load_model(path, progress=False)


def test_wrong_shape_names_tensor_and_both_shapes(good_checkpoint, tmp_path):
    name = "backbone.layers.2.mixer.q_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1]

    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=shrink)
    with pytest.raises(CheckpointError) as err:
        jaxmodels.load_model(path, progress=False)
    message = str(err.value)
    assert "layers.2.mixer.q_proj.weight" in message
    assert "(47, 48)" in message and "(48, 48)" in message


def test_unexpected_tensor_is_named(good_checkpoint, tmp_path):
    def add(tensors):
        tensors["backbone.layers.0.mixer.surprise"] = tensors["backbone.layers.0.mixer.D"]

    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*layers\.0\.mixer\.surprise"):
        jaxmodels.load_model(path, progress=False)


def test_bad_pattern_letter(good_checkpoint, tmp_path):
    def bad_pattern(config):
        config.pop("layers_block_type")
        config["hybrid_override_pattern"] = "ME*XM"

    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_config=bad_pattern)
    with pytest.raises(ConfigError, match=r"hybrid_override_pattern(.|\n)*'X'"):
        jaxmodels.load_model(path, progress=False)


def test_heads_not_divisible_by_groups(good_checkpoint, tmp_path):
    path = edited_copy(good_checkpoint, tmp_path / "ckpt", edit_config=lambda c: c.update(n_groups=4))
    with pytest.raises(ConfigError, match="mamba_num_heads"):
        jaxmodels.load_model(path, progress=False)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type"):
        jaxmodels.load_model(tmp_path, progress=False)


def test_no_weights(good_checkpoint, tmp_path):
    os.makedirs(tmp_path / "ckpt")
    shutil.copy(os.path.join(good_checkpoint, "config.json"), tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        jaxmodels.load_model(tmp_path / "ckpt", progress=False)
