"""The same weights through every entry: sharded safetensors, torch .bin, in-memory torch, orbax round trip."""

import numpy as np
import pytest
import torch

import jaxmodels
from bridge import is_converted_dir, jax_to_torch, torch_to_jax
from tests.hf_models import logits_of, make_nemotron_h, save
from tests.numerics import max_relative_error

INPUT_IDS = np.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]])


@pytest.fixture(scope="module")
def hf_model():
    return make_nemotron_h("moe", seed=11)


@pytest.fixture(scope="module")
def reference_logits(hf_model):
    return logits_of(hf_model, INPUT_IDS).numpy()


def assert_matches(model, reference):
    got = np.asarray(model(INPUT_IDS))
    assert max_relative_error(got, reference) < 1e-4


def test_sharded_safetensors(hf_model, reference_logits, tmp_path):
    save(hf_model, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_matches(jaxmodels.load_model(tmp_path, progress=False), reference_logits)


def test_torch_bin(hf_model, reference_logits, tmp_path):
    hf_model.config.save_pretrained(tmp_path)
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    assert_matches(jaxmodels.load_model(tmp_path, progress=False), reference_logits)


def test_from_torch_in_memory(hf_model, reference_logits):
    assert_matches(jaxmodels.from_torch(hf_model, progress=False), reference_logits)


def test_orbax_round_trip_skips_conversion(hf_model, reference_logits, tmp_path):
    checkpoint = save(hf_model, tmp_path / "hf")
    cache = tmp_path / "converted"
    first = jaxmodels.load_model(checkpoint, converted_cache=cache, progress=False)
    assert is_converted_dir(cache)
    (checkpoint / "model.safetensors").unlink()  # a second load must not need the HF weights
    second = jaxmodels.load_model(checkpoint, converted_cache=cache, progress=False)
    assert_matches(first, reference_logits)
    assert_matches(second, reference_logits)
    assert_matches(jaxmodels.load_model(cache, progress=False), reference_logits)
    with pytest.raises(ValueError, match="bfloat16"):
        jaxmodels.load_model(cache, dtype="bfloat16", progress=False)


def test_bfloat16_load_keeps_router_in_float32(hf_model, tmp_path):
    model = jaxmodels.load_model(save(hf_model, tmp_path), dtype="bfloat16", progress=False)
    moe = model.layers[1].mixer
    assert moe.gate.weight[...].dtype == np.float32
    assert moe.experts.up_proj[...].dtype == jax_dtype("bfloat16")
    logits = np.asarray(model(INPUT_IDS))
    assert np.isfinite(logits).all()


def jax_dtype(name):
    import jax.numpy as jnp

    return jnp.dtype(name)


def test_dlpack_round_trip_shares_memory():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    array = torch_to_jax(tensor)
    np.testing.assert_array_equal(np.asarray(array), tensor.numpy())
    back = jax_to_torch(array)
    assert back.data_ptr() == tensor.data_ptr()
    bf16 = torch_to_jax(tensor.to(torch.bfloat16))
    assert str(bf16.dtype) == "bfloat16"
