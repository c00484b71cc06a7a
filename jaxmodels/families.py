"""The supported model families: each HF `model_type` with the config class that parses it and the model class that
serves it. Adding an architecture is one row here."""

import dataclasses

import jax.numpy as jnp

from jaxmodels.configs.base import ConfigError, read_config_dict
from jaxmodels.configs.deepseek_v32 import DeepseekV32Config, GlmMoeDsaConfig
from jaxmodels.configs.nemotron_h import NemotronHConfig
from jaxmodels.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from jaxmodels.models.nemotron_h import NemotronHForCausalLM
from jaxmodels.nnx_params import abstract_module
from jaxmodels.quantization import with_fp8_weights


@dataclasses.dataclass(frozen=True)
class Family:
    config_class: type
    model_class: type


FAMILIES = {
    "nemotron_h": Family(NemotronHConfig, NemotronHForCausalLM),
    "deepseek_v32": Family(DeepseekV32Config, DeepseekV32ForCausalLM),
    "glm_moe_dsa": Family(GlmMoeDsaConfig, GlmMoeDsaForCausalLM),
}


def family_of(model_type) -> Family:
    """The family of an HF `model_type`, or a `ConfigError` naming the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError("model_type", f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def model_class(config) -> type:
    """The model class that serves `config`."""
    return family_of(config.model_type).model_class


def load_config(source):
    """A typed config from a checkpoint directory, a `config.json` path or an already-parsed dict. Every config
    validates itself on construction and raises `ConfigError` naming the offending field."""
    raw = read_config_dict(source)
    return family_of(raw.get("model_type")).config_class.from_hf(raw)


def abstract_model(config, dtype, matmul_precision: str | None = None):
    """(graphdef, abstract state, {dotted path: ShapeDtypeStruct}) of the model for `config`, allocating no
    weight. The layers an FP8 checkpoint quantizes hold FP8 weights (`config.quantization`)."""
    dtype = jnp.dtype(dtype)
    return abstract_module(lambda: with_fp8_weights(
        model_class(config)(config, dtype=dtype, matmul_precision=matmul_precision), config))
