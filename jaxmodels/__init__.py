"""JAX/Flax inference for Nemotron-H hybrids and DSA models (DeepSeek-V3.2, GLM-5)."""

from jaxmodels.configs import ConfigError, load_config
from jaxmodels.loading import load_model

__all__ = ["ConfigError", "load_config", "load_model"]
