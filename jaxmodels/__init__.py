"""JAX/Flax inference for Nemotron-H hybrids and DSA models (DeepSeek-V3.2, GLM-5)."""

import os

# A decode step is one CUDA graph of a thousand-odd kernels, launched while the previous step's graph still runs
# (overlapped scheduling): with CUDA's default launch queues the launch waits for room. Four times larger queues
# took 0.45 ms off the host time of a Nano-9B decode step on the H200 (docs/BENCHMARKS.md). Read when CUDA starts,
# so it only applies when nothing has touched the GPU yet; a value the user set wins.
os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")

from jaxmodels.configs import ConfigError
from jaxmodels.families import load_config
from jaxmodels.loading import from_torch, load_model
from jaxmodels.llm import LLM, RequestOutput, SamplingParams

__all__ = ["ConfigError", "LLM", "RequestOutput", "SamplingParams", "from_torch", "load_config", "load_model"]
