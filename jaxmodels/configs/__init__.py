"""Typed model configs read from Hugging Face `config.json` files, one class per family. `load_config`, which picks
the class by `model_type`, lives with the family table (jaxmodels/families.py): the table also names the model
classes, which import these configs."""

from jaxmodels.configs.base import ConfigError, read_config_dict
from jaxmodels.configs.deepseek_v32 import DeepseekV32Config, GlmMoeDsaConfig
from jaxmodels.configs.nemotron_h import NemotronHConfig


__all__ = [
    "ConfigError", "NemotronHConfig", "DeepseekV32Config", "GlmMoeDsaConfig", "read_config_dict",
]
