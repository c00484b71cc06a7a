"""Typed model configs read from Hugging Face `config.json` files.

`load_config(path_or_dict)` dispatches on `model_type` to the family's config class. Every config validates itself
on construction and raises `ConfigError` naming the offending field.
"""

from jaxmodels.configs.base import ConfigError, read_config_dict
from jaxmodels.configs.deepseek_v32 import DeepseekV32Config, GlmMoeDsaConfig
from jaxmodels.configs.nemotron_h import NemotronHConfig

CONFIG_CLASSES = {
    "nemotron_h": NemotronHConfig,
    "deepseek_v32": DeepseekV32Config,
    "glm_moe_dsa": GlmMoeDsaConfig,
}


def load_config(source):
    """A typed config from a checkpoint directory, a `config.json` path or an already-parsed dict."""
    raw = read_config_dict(source)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ConfigError(
            "model_type", f"unsupported model_type {model_type!r}; supported: {sorted(CONFIG_CLASSES)}"
        )
    return CONFIG_CLASSES[model_type].from_hf(raw)


__all__ = [
    "ConfigError", "NemotronHConfig", "DeepseekV32Config", "GlmMoeDsaConfig", "load_config", "read_config_dict",
    "CONFIG_CLASSES",
]
