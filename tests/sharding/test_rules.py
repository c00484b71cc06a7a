"""Param partition rules by declared logical axes: every param of every tiny model declares axes the rules know, an
undeclared param or an unknown axis is an error, and representative params get the layout sharding.rules documents.

Built abstractly (no weight allocated, no checkpoint); the rules read only the mesh's axis sizes, so an abstract
(2, 4) mesh stands in for 8 devices.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmodels.families import abstract_model, load_config
from jaxmodels.nnx_params import abstract_state, merge_params, model_params, param_axes, param_blocks
from sharding import manual_part, param_partition_specs, spec_for
from sharding.rules import ALL, PARAM_AXIS_RULES
from tests.hf_models import DSA_BASE, DSA_VARIANTS, NEMOTRON_H_BASE, NEMOTRON_H_VARIANTS

MESH = jax.sharding.AbstractMesh((2, 4), ("dp", "tp"))


def nemotron_h(variant: str, **overrides) -> dict:
    return {"model_type": "nemotron_h", **NEMOTRON_H_BASE, **NEMOTRON_H_VARIANTS[variant], **overrides}


def dsa(variant: str, **overrides) -> dict:
    model_type = "glm_moe_dsa" if variant.startswith("glm") else "deepseek_v32"
    return {"model_type": model_type, **DSA_BASE, **DSA_VARIANTS[variant], **overrides}


# Every tiny model of both families, and the biases the tiny ones leave out.
CONFIGS = {
    **{f"nemotron_h_{variant}": nemotron_h(variant) for variant in NEMOTRON_H_VARIANTS},
    "nemotron_h_moe_fp8": nemotron_h("moe", quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}),
    "deepseek_v32_fp8": dsa("deepseek_v32", quantization_config={"quant_method": "fp8",
                                                                 "weight_block_size": [128, 128]}),
    "nemotron_h_mlp_bias": nemotron_h("dense", mlp_bias=True, mamba_proj_bias=True),
    **{variant: dsa(variant) for variant in DSA_VARIANTS},
    "deepseek_v32_attention_bias": dsa("deepseek_v32", attention_bias=True),
}


def params_and_axes(name: str) -> tuple[dict, dict]:
    _, state, params = abstract_model(load_config(CONFIGS[name]), jnp.float32)
    return params, param_axes(state)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_param_declares_known_logical_axes(name):
    params, axes = params_and_axes(name)
    assert axes.keys() == params.keys()
    undeclared = [path for path, names in axes.items() if names is None]
    assert not undeclared
    unknown = {(path, axis) for path, names in axes.items() for axis in names if axis not in PARAM_AXIS_RULES}
    assert not unknown
    assert all(len(axes[path]) == value.ndim for path, value in params.items())
    param_partition_specs(params, axes, MESH)  # and the specs build


def test_axes_survive_loading_and_the_engines_abstract_state():
    """The bridge builds models abstractly and fills them (merge_params); the engine keeps a shapes-only state."""
    graphdef, state, abstract = abstract_model(load_config(CONFIGS["nemotron_h_moe"]), jnp.float32)
    model = merge_params(graphdef, state, {path: jnp.zeros(a.shape, a.dtype) for path, a in abstract.items()})
    assert param_axes(model) == param_axes(abstract_state(nnx.state(model))) == param_axes(state)


def test_param_without_axes_is_an_error_naming_it():
    class Layer(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.ones((4,)))

    layer = Layer()
    with pytest.raises(ValueError, match=r"param scale declares no logical axes"):
        param_partition_specs(model_params(layer), param_axes(layer), MESH)


def test_unknown_logical_axis_is_an_error_naming_param_and_axis():
    with pytest.raises(ValueError, match=r"param layers\.0\.w has logical axes \['heds'\]"):
        spec_for(("embed", "heds"), (8, 8), MESH, param="layers.0.w")


def test_axes_of_the_wrong_rank_are_an_error():
    with pytest.raises(ValueError, match=r"param w declares logical axes \('embed',\) for its 2 dimensions"):
        spec_for(("embed",), (8, 8), MESH, param="w")


EXPECTED = {
    "nemotron_h_moe": {  # layers "ME*EM"; 8 experts divide the 8 devices
        "layers.0.mixer.in_proj.kernel": P(None, None),  # Mamba whole
        "layers.0.mixer.conv1d.weight": P(None, None),
        "layers.0.mixer.A_log": P(None),
        "layers.0.norm.weight": P(None),
        "layers.1.mixer.gate.weight": P(None, None),  # router whole
        "layers.1.mixer.gate.e_score_correction_bias": P(None),
        "layers.1.mixer.experts.up_proj": P(ALL, None, None),  # expert parallel
        "layers.1.mixer.experts.down_proj": P(ALL, None, None),
        "layers.1.mixer.shared_experts.up_proj.kernel": P(None, ALL),
        "layers.1.mixer.shared_experts.down_proj.kernel": P(ALL, None),
        "layers.2.mixer.q_proj.kernel": P(None, "tp"),  # heads over tp
        "layers.2.mixer.k_proj.kernel": P(None, "tp"),
        "layers.2.mixer.o_proj.kernel": P("tp", None),
        "lm_head.kernel": P(None, None),  # a vocabulary of 97 does not divide tp=4: whole, not padded
    },
    "nemotron_h_latent_moe": {  # 6 experts do not divide 8 devices: each expert's intermediate dimension does
        "layers.1.mixer.experts.up_proj": P(None, None, ALL),
        "layers.1.mixer.experts.down_proj": P(None, ALL, None),
        "layers.1.mixer.fc1_latent_proj.kernel": P(None, None),
    },
    "nemotron_h_mlp_bias": {  # layers "M*-M-M"
        "layers.2.mixer.up_proj.kernel": P(None, ALL),
        "layers.2.mixer.up_proj.bias": P(None),  # biases replicated
        "layers.2.mixer.down_proj.kernel": P(ALL, None),
    },
    "deepseek_v32": {  # layer 0 dense, layers 1-2 MoE with 8 experts
        "embed_tokens.embedding": P(None, None),  # 101 rows
        "layers.0.mlp.gate_proj.kernel": P(None, ALL),
        "layers.0.mlp.down_proj.kernel": P(ALL, None),
        "layers.1.mlp.experts.gate_proj": P(ALL, None, None),
        "layers.1.mlp.shared_experts.up_proj.kernel": P(None, None),  # 20 wide: does not divide 8 devices
        "layers.1.self_attn.q_b_proj.kernel": P(None, None),  # MLA whole
        "layers.1.self_attn.kv_b_proj.kernel": P(None, None),
        "layers.1.self_attn.o_proj.kernel": P(None, None),
        "layers.1.self_attn.indexer.wq_b.kernel": P(None, None),
        "layers.1.self_attn.indexer.k_norm.bias": P(None),
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_representative_specs_on_a_2x4_mesh(name):
    params, axes = params_and_axes(name)
    specs = param_partition_specs(params, axes, MESH)
    assert {path: specs[path] for path in EXPECTED[name]} == EXPECTED[name]


# FP8 checkpoints (jaxmodels.quantization): block-scaled DeepSeek-V3.2 with dims whose 128-blocks divide the 8
# devices or not, per-tensor (ModelOpt) Nemotron-H with 8 and with 6 experts.
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TENSOR_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}
FP8_CONFIGS = {
    "deepseek_v32_fp8": dsa("deepseek_v32", hidden_size=256, intermediate_size=1024, moe_intermediate_size=512,
                            quantization_config=BLOCK_FP8),
    "nemotron_h_moe_fp8": nemotron_h("moe", quantization_config=TENSOR_FP8),
    "nemotron_h_latent_moe_fp8": nemotron_h("latent_moe", quantization_config=TENSOR_FP8),
}


def fp8_specs(name: str) -> dict:
    _, state, params = abstract_model(load_config(FP8_CONFIGS[name]), jnp.float32)
    return param_partition_specs(params, param_axes(state), MESH, param_blocks(state))


@pytest.mark.parametrize("name", sorted(FP8_CONFIGS))
def test_fp8_scales_shard_with_their_weights(name):
    """A block scale covers the same rows and columns on every device as the weight it scales: their specs are
    equal. A per-tensor scale follows its weight's expert split, if any."""
    specs = fp8_specs(name)
    scales = [path for path in specs if path.endswith(("weight_scale_inv", "weight_scale", "input_scale"))]
    assert scales
    for path in scales:
        weight = specs[path.rsplit(".", 1)[0] + ".weight"]
        expected = weight if path.endswith("weight_scale_inv") else P(*weight[: len(specs[path])])
        assert specs[path] == expected, path


FP8_EXPECTED = {
    "deepseek_v32_fp8": {
        "layers.0.mlp.gate_proj.weight": P(ALL, None),  # 1024 rows: 8 blocks, one per device
        "layers.0.mlp.down_proj.weight": P(None, ALL),
        "layers.1.mlp.experts.gate_proj.weight": P(ALL, None, None),  # expert parallel
        "layers.1.mlp.shared_experts.up_proj.weight": P(None, None),  # 512 rows divide 8 devices, 4 blocks do not
        "layers.1.mlp.shared_experts.up_proj.weight_scale_inv": P(None, None),
    },
    "nemotron_h_latent_moe_fp8": {  # per-tensor: no blocks; 6 experts do not divide 8 devices, 16 columns do
        "layers.1.mixer.experts.up_proj.weight": P(None, ALL, None),
        "layers.1.mixer.experts.up_proj.weight_scale": P(None),
        "layers.1.mixer.experts.up_proj.input_scale": P(None),
    },
}


@pytest.mark.parametrize("name", sorted(FP8_EXPECTED))
def test_representative_fp8_specs_on_a_2x4_mesh(name):
    specs = fp8_specs(name)
    assert {path: specs[path] for path in FP8_EXPECTED[name]} == FP8_EXPECTED[name]


def test_manual_part_keeps_one_axis_of_each_dimension():
    """What a shard_map manual over one axis states: the engine's step over "dp", the kernels' calls over "tp"."""
    spec = P(ALL, None, "tp", "dp")
    assert manual_part(spec, "dp") == P("dp", None, None, "dp")
    assert manual_part(spec, "tp") == P("tp", None, "tp", None)
    assert manual_part(P(), "tp") == P()
