"""JAX/Flax inference for Nemotron-H hybrids and DSA models (DeepSeek-V3.2, GLM-5)."""

from jaxmodels.configs import ConfigError
from jaxmodels.families import load_config
from jaxmodels.loading import from_torch, load_model
from jaxmodels.llm import LLM, RequestOutput, SamplingParams

__all__ = ["ConfigError", "LLM", "RequestOutput", "SamplingParams", "from_torch", "load_config", "load_model"]
