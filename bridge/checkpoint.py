"""Lazy readers over checkpoint tensors: safetensors (single file or sharded index), torch `.bin`, in-memory dicts.

A reader knows each tensor's shape without loading it, so the loader can check a whole checkpoint before it
reads a byte of weights. Names are normalized by dropping the base-model prefix (`backbone.` in NVIDIA's
checkpoints, `model.` in transformers' own), so rules see `layers.0.mixer.in_proj.weight` either way.

Safetensors files are read from their own header (a JSON table of dtype, shape and byte range per tensor), so every
dtype published checkpoints use reads into numpy, bfloat16 and the FP8 formats included (through ml_dtypes): the
`safetensors` package's numpy reader knows neither.
"""

import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from bridge.torch_interop import torch_to_numpy

BASE_MODEL_PREFIXES = ("backbone.", "model.")


class CheckpointError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors, or unreadable files.
    `missing` holds the names of the absent tensors, if any."""

    def __init__(self, message: str, *, missing: tuple[str, ...] = ()):
        super().__init__(message)
        self.missing = tuple(missing)


def normalize_name(name: str) -> str:
    for prefix in BASE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


class CheckpointReader:
    """Tensors by normalized name: `names()`, `shape(name)`, `read(name) -> np.ndarray` (read on demand)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read_fn: Callable[[str], np.ndarray], source: str):
        self._shapes = shapes
        self._read = read_fn
        self.source = source

    def names(self) -> Iterable[str]:
        return self._shapes.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str) -> np.ndarray:
        return self._read(name)


def _normalized_index(raw_names: Iterable[str], source: str) -> dict[str, str]:
    index = {}
    for raw in raw_names:
        name = normalize_name(raw)
        if name in index:
            raise CheckpointError(f"{source}: tensors {index[name]!r} and {raw!r} map to the same name {name!r}")
        index[name] = raw
    return index


# safetensors dtype names -> numpy dtypes.
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


def _safetensors_table(path: str) -> tuple[dict, int]:
    """({raw name: {dtype, shape, data_offsets}}, where the data starts) of a safetensors file."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        table = json.loads(f.read(header_size))
    table.pop("__metadata__", None)
    return table, 8 + header_size


def _safetensors_reader(files: list[str], source: str) -> CheckpointReader:
    shapes, where = {}, {}
    for path in files:
        table, data_start = _safetensors_table(path)
        for raw, entry in table.items():
            name = normalize_name(raw)
            if name in where:
                raise CheckpointError(f"{source}: tensor {name!r} appears twice ({raw!r})")
            where[name] = (path, data_start, entry)
            shapes[name] = tuple(entry["shape"])

    def read(name):
        path, data_start, entry = where[name]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which we cannot read")
        begin, end = entry["data_offsets"]
        data = bytearray(end - begin)
        with open(path, "rb") as f:
            f.seek(data_start + begin)
            f.readinto(data)
        return np.frombuffer(data, SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    return CheckpointReader(shapes, read, source)


def _torch_bin_reader(files: list[str], source: str) -> CheckpointReader:
    try:
        import torch
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise CheckpointError(f"{source} holds torch .bin weights: install torch to read them "
                              "(pip install 'jaxmodels[torch]')") from err
    tensors = {}
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        for raw, tensor in state.items():
            tensors[raw] = tensor
    return dict_reader(tensors, source, to_numpy=torch_to_numpy)


def dict_reader(tensors: dict, source: str, to_numpy: Callable = np.asarray) -> CheckpointReader:
    """A reader over in-memory tensors (numpy, jax or torch through `to_numpy`)."""
    index = _normalized_index(tensors.keys(), source)
    shapes = {name: tuple(tensors[raw].shape) for name, raw in index.items()}
    return CheckpointReader(shapes, lambda name: to_numpy(tensors[index[name]]), source)


def _sharded_files(directory: str, index_name: str) -> list[str]:
    with open(os.path.join(directory, index_name)) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    missing = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise CheckpointError(f"{directory}: {index_name} lists shard files that are absent: {missing}")
    return [os.path.join(directory, name) for name in files]


def open_checkpoint(path) -> CheckpointReader:
    """A reader over the weights of an HF checkpoint directory (or a single weights file)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return (_safetensors_reader if path.endswith(".safetensors") else _torch_bin_reader)([path], path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} does not exist")
    for index_name, make in (("model.safetensors.index.json", _safetensors_reader),
                             ("pytorch_model.bin.index.json", _torch_bin_reader)):
        if os.path.isfile(os.path.join(path, index_name)):
            return make(_sharded_files(path, index_name), path)
    for file_name, make in (("model.safetensors", _safetensors_reader), ("pytorch_model.bin", _torch_bin_reader)):
        if os.path.isfile(os.path.join(path, file_name)):
            return make([os.path.join(path, file_name)], path)
    raise CheckpointError(f"{path}: no model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
                          "pytorch_model.bin.index.json found")
