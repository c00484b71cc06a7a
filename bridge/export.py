"""Writing a model's params as a Hugging Face checkpoint (safetensors + config.json), the inverse of loading.

Used by the demo, which builds a random model and must serve it from disk through the bridge without torch, and
by tests that check the layout round-trips through transformers.
"""

import json
import os

import numpy as np
from safetensors.numpy import save_file

from bridge.rules import source_for
from jaxmodels.models.registry import model_params


class _NoStackedTensors:
    """A reader with no tensors: rules then pick the published per-expert layout."""

    def __contains__(self, name):
        return False


def hf_tensors(model) -> dict[str, np.ndarray]:
    """{HF checkpoint name: array} for `model`'s params."""
    prefix = type(model).HF_BASE_PREFIX
    tensors = {}
    for path, value in model_params(model).items():
        value = np.asarray(value)
        source = source_for(path, value.shape, _NoStackedTensors())
        for name, array in zip(source.names, source.disassemble(value)):
            full_name = name if name.startswith("lm_head.") else prefix + name
            tensors[full_name] = np.ascontiguousarray(array)
    return tensors


def save_hf_checkpoint(model, raw_config: dict, directory) -> str:
    """Write `model.safetensors` and `config.json` into `directory`; return the directory."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    save_file(hf_tensors(model), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(raw_config, f, indent=1)
    return directory
