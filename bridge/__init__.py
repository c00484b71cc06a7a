"""Hugging Face checkpoints -> our params: lazy safetensors / torch readers, name rules, strict loading, torch <->
jax through DLPack, and orbax save/restore of converted params."""

from bridge.checkpoint import CheckpointError, CheckpointReader, open_checkpoint
from bridge.loader import load_params
from bridge.torch_interop import from_torch, jax_to_torch, torch_to_jax
from bridge.converted import is_converted_dir, restore_converted, save_converted

__all__ = [
    "CheckpointError", "CheckpointReader", "open_checkpoint", "load_params", "from_torch", "jax_to_torch",
    "torch_to_jax", "is_converted_dir", "restore_converted", "save_converted",
]
