"""Multi-token-prediction (MTP) layers at load time. The MTP layers a config declares are loaded as strictly as the
rest: a checkpoint that lacks their tensors fails naming them and the way out (`load_mtp=False`, which builds the
model without them). A checkpoint without MTP layers loads; its model refuses to draft. DeepSeek's copies of the
target's embedding and LM head are not needed; converted copies keep what was loaded."""

import re

import numpy as np
import pytest

import jaxmodels
from bridge import CheckpointError
from bridge.checkpoint import normalize_name
from jaxmodels.nnx_params import model_params
from tests.bridge.test_loading_errors import edited_copy
from tests.hf_models import make_nemotron_h, save
from tests.hf_mtp import save_with_mtp

# Per family: the checkpoint-name prefix of all its MTP layer's tensors, and of the block holding enorm, hnorm, eh_proj.
MTP_PREFIXES = {"deepseek_v32": ("model.layers.3.", "model.layers.3."), "nemotron_h_moe": ("mtp.", "mtp.layers.0.")}


@pytest.fixture(scope="module", params=list(MTP_PREFIXES))
def with_mtp(request, tmp_path_factory):
    """(variant, checkpoint whose config declares one MTP layer, with its tensors)."""
    path = tmp_path_factory.mktemp(request.param)
    save_with_mtp(request.param, path)
    return request.param, path


def fusion_tensor(variant: str, name: str) -> str:
    return MTP_PREFIXES[variant][1] + name


def named(raw_name: str) -> str:
    """A regex for the tensor as error messages name it (normalized)."""
    return re.escape(normalize_name(raw_name))


def without_mtp_tensors(checkpoint, variant, destination):
    def drop(tensors):
        for name in [n for n in tensors if n.startswith(MTP_PREFIXES[variant][0])]:
            tensors.pop(name)

    return edited_copy(checkpoint, destination, edit_tensors=drop)


def test_declared_but_absent_mtp_layer_is_named(with_mtp, tmp_path):
    variant, checkpoint = with_mtp
    path = without_mtp_tensors(checkpoint, variant, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"missing(.|\n)*" + named(fusion_tensor(variant, "eh_proj.weight"))):
        jaxmodels.load_model(path, progress=False)


def test_absent_mtp_layer_error_names_the_way_out(with_mtp, tmp_path):
    variant, checkpoint = with_mtp
    path = without_mtp_tensors(checkpoint, variant, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="load_mtp=False"):
        jaxmodels.load_model(path, progress=False)


def test_one_absent_mtp_tensor_is_named(with_mtp, tmp_path):
    variant, checkpoint = with_mtp
    hnorm = fusion_tensor(variant, "hnorm.weight")
    path = edited_copy(checkpoint, tmp_path / "ckpt", edit_tensors=lambda tensors: tensors.pop(hnorm))
    with pytest.raises(CheckpointError, match=r"missing(.|\n)*" + named(hnorm)):
        jaxmodels.load_model(path, progress=False)


@pytest.mark.parametrize("tensors", ["present", "absent"])
def test_load_mtp_false_builds_no_mtp_layers(with_mtp, tmp_path, tensors):
    variant, checkpoint = with_mtp
    path = checkpoint if tensors == "present" else without_mtp_tensors(checkpoint, variant, tmp_path / "ckpt")
    model = jaxmodels.load_model(path, progress=False, load_mtp=False)
    assert model.num_mtp_layers == 0
    assert not [name for name in model_params(model) if "mtp" in name]


def test_model_without_mtp_layers_cannot_draft(with_mtp):
    _, checkpoint = with_mtp
    model = jaxmodels.load_model(checkpoint, progress=False, load_mtp=False)
    hidden = model.hidden_states(np.array([[1, 2, 3]]))
    with pytest.raises(ValueError, match="no multi-token-prediction"):
        model.mtp_step(hidden, np.array([[2, 3, 4]]))


def test_checkpoint_without_mtp_layers_loads(tmp_path):
    model = jaxmodels.load_model(save(make_nemotron_h("moe"), tmp_path), progress=False)
    assert model.num_mtp_layers == 0


def test_mtp_tensors_the_config_does_not_declare_are_unexpected(with_mtp, tmp_path):
    variant, checkpoint = with_mtp
    path = edited_copy(checkpoint, tmp_path / "ckpt", edit_config=lambda c: c.update(num_nextn_predict_layers=0))
    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*" + named(fusion_tensor(variant, "eh_proj.weight"))):
        jaxmodels.load_model(path, progress=False)


def test_deepseek_copies_of_embedding_and_head_are_not_needed(tmp_path):
    """`layers.3.embed_tokens` and `layers.3.shared_head.head` copy the target's tensors, which the MTP layer uses."""
    checkpoint = tmp_path / "full"
    save_with_mtp("deepseek_v32", checkpoint)

    def drop_copies(tensors):
        tensors.pop("model.layers.3.embed_tokens.weight")
        tensors.pop("model.layers.3.shared_head.head.weight")

    model = jaxmodels.load_model(edited_copy(checkpoint, tmp_path / "ckpt", edit_tensors=drop_copies), progress=False)
    assert model.num_mtp_layers == 1


@pytest.mark.parametrize("load_mtp", [True, False])
def test_converted_copy_holds_what_was_loaded(with_mtp, tmp_path, load_mtp):
    _, checkpoint = with_mtp
    loaded = jaxmodels.load_model(checkpoint, converted_cache=tmp_path / "converted", progress=False,
                                  load_mtp=load_mtp)
    restored = jaxmodels.load_model(tmp_path / "converted", progress=False)
    expected, params = model_params(loaded), model_params(restored)
    assert params.keys() == expected.keys()
    assert all(np.array_equal(params[name], expected[name]) for name in expected)


def test_converted_copy_restores_without_mtp_layers(with_mtp, tmp_path):
    _, checkpoint = with_mtp
    jaxmodels.load_model(checkpoint, converted_cache=tmp_path / "converted", progress=False)
    assert jaxmodels.load_model(tmp_path / "converted", progress=False, load_mtp=False).num_mtp_layers == 0
