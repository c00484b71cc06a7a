"""Loading FP8 checkpoints stays strict, and reads what the published configs say.

A scale that does not fit its weight names both; a missing scale is named; FP8 values where the model expects dense
ones (or the reverse) are refused; a config's list of unquantized modules is honored; an unknown `quant_method` or
ModelOpt algorithm is a config error naming it; ModelOpt's FP8 KV-cache scales are read past where the config declares
them. The MTP layers of an FP8 checkpoint load in FP8 too (their
`eh_proj` stays dense, as published), and an FP8 model round-trips through the orbax cache. The safetensors reader
reads the dtypes published checkpoints hold (bfloat16, FP8).
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

import jaxmodels
from bridge import CheckpointError, open_checkpoint
from jaxmodels import ConfigError
from jaxmodels.configs.quantization import Fp8Config, fp8_config_from_hf
from jaxmodels.families import abstract_model, load_config
from jaxmodels.layers.fp8_linear import Fp8Linear
from jaxmodels.nnx_params import model_params
from tests.fp8_bounds import EPSILON, GEMMS_IN_SERIES
from tests.hf_fp8 import DSA_QUANTIZATION_CONFIG, DSA_QUANTIZED, make_fp8_case, quantize_checkpoint
from tests.hf_models import DSA_BASE, make_dsa, save
from tests.hf_mtp import save_with_mtp
from tests.numerics import rms_relative_error

SCALE = "model.layers.0.self_attn.q_b_proj.weight_scale_inv"  # q_b_proj [72, 24]: one (partial) block


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8")
    source = save(make_dsa("deepseek_v32"), directory / "f32")
    return quantize_checkpoint(source, directory, quantized=lambda name: bool(DSA_QUANTIZED.match(name)),
                               block=True, quantization_config=DSA_QUANTIZATION_CONFIG).fp8_dir


def edited(checkpoint, destination, edit) -> str:
    """A copy of the checkpoint with its tensors edited as torch tensors (numpy has no e4m3; `edited_copy` of
    test_loading_errors edits numpy arrays)."""
    shutil.copytree(checkpoint, destination)
    path = os.path.join(destination, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return destination


def test_a_scale_that_does_not_fit_its_weight_names_both(fp8_checkpoint, tmp_path):
    def widen(tensors):
        tensors[SCALE] = torch.ones(2, 1)

    with pytest.raises(CheckpointError) as err:
        jaxmodels.load_model(edited(fp8_checkpoint, tmp_path / "ckpt", widen), progress=False)
    message = str(err.value)
    assert "layers.0.self_attn.q_b_proj.weight_scale_inv: checkpoint shape (2, 1), model expects (1, 1)" in message
    assert "block of its weight layers.0.self_attn.q_b_proj.weight, shape (72, 24) in the checkpoint" in message


def test_an_expert_scale_that_does_not_fit_names_its_weight(fp8_checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"

    def widen(tensors):
        tensors[name] = torch.ones(1, 2)

    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj\.weight_scale_inv: checkpoint shape \(1, 2\), "
                                              r"model expects \(1, 1\).*block of its weight"):
        jaxmodels.load_model(edited(fp8_checkpoint, tmp_path / "ckpt", widen), progress=False)


def test_a_missing_scale_is_named(fp8_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match=r"missing(.|\n)*layers\.0\.self_attn\.q_b_proj\.weight_scale_inv"):
        jaxmodels.load_model(edited(fp8_checkpoint, tmp_path / "ckpt", lambda t: t.pop(SCALE)), progress=False)


def test_dense_values_where_fp8_ones_belong_are_refused(fp8_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.q_b_proj.weight"

    def densify(tensors):
        tensors[name] = tensors[name].float()

    with pytest.raises(CheckpointError, match=r"q_b_proj\.weight holds float32 values where the model expects "
                                              r"float8_e4m3fn"):
        jaxmodels.load_model(edited(fp8_checkpoint, tmp_path / "ckpt", densify), progress=False)


def test_a_scale_beside_a_layer_published_unquantized_is_unexpected(fp8_checkpoint, tmp_path):
    name = "model.layers.0.self_attn.indexer.weights_proj.weight"

    def quantize(tensors):
        tensors[name[: -len("weight")] + "weight_scale_inv"] = torch.ones(1, 1)

    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*indexer\.weights_proj\.weight_scale_inv"):
        jaxmodels.load_model(edited(fp8_checkpoint, tmp_path / "ckpt", quantize), progress=False)


def test_modules_the_config_leaves_unquantized_stay_dense():
    raw = {"model_type": "deepseek_v32", **DSA_BASE,
           "quantization_config": {**DSA_QUANTIZATION_CONFIG,
                                   "modules_to_not_convert": ["model.layers.0.mlp", "o_proj"]}}
    _, _, params = abstract_model(load_config(raw), jnp.float32)
    assert params["layers.0.mlp.down_proj.kernel"].dtype == jnp.float32  # a module under a listed one
    assert params["layers.1.self_attn.o_proj.kernel"].dtype == jnp.float32  # listed by its last name
    assert params["layers.1.mlp.experts.down_proj.weight"].dtype == jnp.float8_e4m3fn
    assert params["layers.0.self_attn.kv_b_proj.weight"].dtype == jnp.float8_e4m3fn
    assert params["lm_head.kernel"].dtype == jnp.float32


@pytest.mark.parametrize("quantization, problem", [
    ({"quant_method": "gptq", "bits": 4}, "unsupported quant_method 'gptq'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt quant_algo 'NVFP4' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fp8 fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8"}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e4m3"}, "scale_fmt 'e4m3'"),
])
def test_unsupported_quantization_is_a_config_error_naming_it(quantization, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config({"model_type": "deepseek_v32", **DSA_BASE, "quantization_config": quantization})


def test_an_unknown_quantization_mode_is_refused(fp8_checkpoint):
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'dequantize'\), got 'int8'"):
        jaxmodels.load_model(fp8_checkpoint, quantization="int8", progress=False)


def test_published_quantization_configs_parse():
    deepseek = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "scale_fmt": "ue8m0"}
    assert fp8_config_from_hf({"quantization_config": deepseek}) == Fp8Config(block=(128, 128), pow2_scales=True)
    flat = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head", "backbone.layers.4.mixer*"]}
    nested = {"quant_method": "modelopt", "quantization": {"quant_algo": "fp8", "kv_cache_quant_algo": None,
                                                           "exclude_modules": ["lm_head", "backbone.layers.4.mixer*"]}}
    expected = Fp8Config(block=None, unquantized=("lm_head", "backbone.layers.4.mixer*"))
    assert fp8_config_from_hf({"quantization_config": flat}) == expected
    assert fp8_config_from_hf({"quantization_config": nested}) == expected
    assert fp8_config_from_hf({}) is None
    with_kv = {**flat, "kv_cache_quant_algo": "FP8"}
    assert fp8_config_from_hf({"quantization_config": with_kv}) == dataclasses.replace(expected, kv_cache_scales=True)
    with pytest.raises(ConfigError, match="kv_cache_quant_algo 'NVFP4' is not supported"):
        fp8_config_from_hf({"quantization_config": {**flat, "kv_cache_quant_algo": "NVFP4"}})


def with_kv_cache_scales(checkpoint, destination, *, declared: bool) -> str:
    """The checkpoint plus ModelOpt's FP8 KV-cache scales on every attention layer (and, when `declared`, the
    config's kv_cache_quant_algo)."""
    def add(tensors):
        for name in [n for n in tensors if n.endswith(".mixer.k_proj.weight")]:
            layer = name[: -len("k_proj.weight")]
            tensors[layer + "k_proj.k_scale"] = torch.tensor(0.02)
            tensors[layer + "v_proj.v_scale"] = torch.tensor(0.03)

    path = edited(checkpoint, destination, add)
    if declared:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["quantization_config"]["kv_cache_quant_algo"] = "FP8"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


def leaf_bytes(array) -> np.ndarray:
    """An array's bytes: an exact comparison that NaNs and signed zeros do not fool."""
    return np.atleast_1d(np.asarray(array)).view(np.uint8)


def test_modelopt_kv_cache_scales_are_read_past(tmp_path):
    """A ModelOpt FP8 Nemotron-H checkpoint with an FP8 KV cache declared loads (its k/v scales unused, the cache
    keeping the model's dtype) into the same model as the checkpoint without them: the same state paths, and every
    leaf of the same dtype, shape and bytes, so any forward of one is the other's. (Logits are not compared: on the
    H200 one compiled forward run twice on the same inputs differed by an ulp in places, the GPU's reductions not
    being bitwise deterministic.) Undeclared, the scales are unexpected tensors, as any other would be."""
    ids = np.random.default_rng(2).integers(0, 97, size=(1, 7))
    plain = make_fp8_case("nemotron_h", tmp_path / "case", calibration_ids=[ids]).fp8_dir
    scaled = with_kv_cache_scales(plain, tmp_path / "kv", declared=True)
    _, state = nnx.split(jaxmodels.load_model(plain, progress=False))
    _, scaled_state = nnx.split(jaxmodels.load_model(scaled, progress=False))
    leaves = jax.tree_util.tree_leaves_with_path(state)
    scaled_leaves = jax.tree_util.tree_leaves_with_path(scaled_state)
    assert [path for path, _ in scaled_leaves] == [path for path, _ in leaves]
    for (path, leaf), (_, scaled_leaf) in zip(leaves, scaled_leaves):
        assert (scaled_leaf.dtype, scaled_leaf.shape) == (leaf.dtype, leaf.shape), jax.tree_util.keystr(path)
        np.testing.assert_array_equal(leaf_bytes(scaled_leaf), leaf_bytes(leaf), err_msg=jax.tree_util.keystr(path))
    undeclared = with_kv_cache_scales(plain, tmp_path / "kv_undeclared", declared=False)
    with pytest.raises(CheckpointError, match=r"unexpected(.|\n)*mixer\.k_proj\.k_scale"):
        jaxmodels.load_model(undeclared, progress=False)


def mtp_logits(model, hidden, ids) -> np.ndarray:
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, hidden, ids: nnx.merge(graphdef, state).mtp_step(hidden, ids)[0])
    return np.asarray(step(state, hidden, jnp.asarray(ids)))


def test_mtp_layers_of_an_fp8_checkpoint_load_in_fp8(tmp_path):
    # No discrete choice may hang on the rounding for the bound below (see tests/hf_fp8.py): every expert, every key.
    save_with_mtp("deepseek_v32", tmp_path / "f32", num_experts_per_tok=8, n_group=1, topk_group=1, index_topk=64,
                  initializer_range=0.02)
    fp8 = quantize_checkpoint(tmp_path / "f32", tmp_path, quantized=lambda name: bool(DSA_QUANTIZED.match(name)),
                              block=True, quantization_config=DSA_QUANTIZATION_CONFIG)
    model = jaxmodels.load_model(fp8.fp8_dir, progress=False)
    dense = jaxmodels.load_model(fp8.fp8_dir, progress=False, quantization="dequantize")
    mtp = model.mtp_layers[0]
    assert isinstance(mtp.self_attn.q_a_proj, Fp8Linear)
    assert model_params(model)["mtp_layers.0.mlp.experts.up_proj.weight"].dtype == jnp.float8_e4m3fn
    assert not isinstance(mtp.eh_proj, Fp8Linear)  # bf16 in the published checkpoints
    ids = np.random.default_rng(0).integers(0, 101, size=(1, 9))
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((1, 9, DSA_BASE["hidden_size"])), jnp.float32)
    got, want = mtp_logits(model, hidden, ids), mtp_logits(dense, hidden, ids)
    # FP8 rounding through one decoder layer, (q_a -> q_b -> o) and (gate, up) -> down (tests/fp8_bounds.py).
    assert 0 < rms_relative_error(got, want) < np.sqrt(GEMMS_IN_SERIES["deepseek_v32"]) * EPSILON


def test_fp8_model_round_trips_through_the_converted_cache(fp8_checkpoint, tmp_path):
    cache = tmp_path / "converted"
    first = jaxmodels.load_model(fp8_checkpoint, converted_cache=cache, progress=False)
    restored = jaxmodels.load_model(cache, progress=False)
    expected, got = model_params(first), model_params(restored)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and np.array_equal(np.asarray(got[name], np.float32),
                                                                 np.asarray(value, np.float32)), name
    dense_cache = tmp_path / "dequantized"
    jaxmodels.load_model(fp8_checkpoint, converted_cache=dense_cache, quantization="dequantize", progress=False)
    with open(dense_cache / "config.json") as f:
        assert "quantization_config" not in json.load(f)


def test_safetensors_reader_reads_bfloat16_and_fp8(tmp_path):
    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": (torch.randn(4, 2) * 50).to(torch.float8_e4m3fn),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "d": torch.tensor(0.25)}
    save_file(tensors, tmp_path / "model.safetensors")
    reader = open_checkpoint(tmp_path / "model.safetensors")
    for name, tensor in tensors.items():
        array = reader.read(name)
        assert reader.shape(name) == tuple(tensor.shape) == array.shape
        np.testing.assert_array_equal(array.astype(np.float64), tensor.double().numpy())
    assert reader.read("a").dtype == ml_dtypes.bfloat16 and reader.read("b").dtype == ml_dtypes.float8_e4m3fn
