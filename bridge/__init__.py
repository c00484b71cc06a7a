"""Hugging Face checkpoints -> our params: lazy safetensors / torch readers, name rules, strict loading, torch <->
jax through DLPack, and orbax save/restore of converted params.

The layer below jaxmodels: it speaks in {dotted path: array} params and imports nothing from jaxmodels, which builds
models on top of it (tests/bridge/test_layering.py holds it to that)."""

from bridge.checkpoint import CheckpointError, CheckpointReader, open_checkpoint
from bridge.loader import load_params
from bridge.torch_interop import jax_to_torch, torch_to_jax
from bridge.converted import is_converted_dir, restore_converted, save_converted

__all__ = [
    "CheckpointError", "CheckpointReader", "open_checkpoint", "load_params", "jax_to_torch", "torch_to_jax",
    "is_converted_dir", "restore_converted", "save_converted",
]
