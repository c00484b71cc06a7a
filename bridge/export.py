"""Writing params as a Hugging Face checkpoint (safetensors + config.json), the inverse of loading.

Used by the demo, which builds a random model and must serve it from disk through the bridge without torch, and
by tests that check the layout round-trips through transformers.
"""

import json
import os

import numpy as np
from safetensors.numpy import save_file

from bridge.rules import source_for


class _NoStackedTensors:
    """A reader with no tensors: rules then pick the published per-expert layout."""

    def __contains__(self, name):
        return False


def hf_tensors(params: dict, base_prefix: str) -> dict[str, np.ndarray]:
    """{HF checkpoint name: array} for `params` ({dotted path: array}); `base_prefix` is the base model's prefix the
    checkpoint names carry (`backbone.`, `model.`), which `lm_head.*` goes without."""
    tensors = {}
    for path, value in params.items():
        value = np.asarray(value)
        source = source_for(path, value.shape, _NoStackedTensors())
        for name, array in zip(source.names, source.disassemble(value)):
            full_name = name if name.startswith("lm_head.") else base_prefix + name
            tensors[full_name] = np.ascontiguousarray(array)
    return tensors


def save_hf_checkpoint(params: dict, raw_config: dict, directory, *, base_prefix: str) -> str:
    """Write `model.safetensors` and `config.json` into `directory`; return the directory."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    save_file(hf_tensors(params, base_prefix), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=1)
    return directory
