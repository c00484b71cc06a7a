"""`load_model`: an HF checkpoint directory (or one we converted) -> an nnx model with its weights."""

import jax.numpy as jnp

from bridge.checkpoint import open_checkpoint
from bridge.converted import converted_dtype, is_converted_dir, restore_converted, save_converted
from bridge.loader import load_params
from jaxmodels.configs import load_config, read_config_dict
from jaxmodels.hub import resolve_model_path
from jaxmodels.models.registry import abstract_model, checkpoint_ignore_patterns, merge_params


def build_from_reader(config, reader, dtype, *, progress: bool = True, matmul_precision: str | None = None):
    """Build the model for `config` with the weights `reader` provides, checked strictly."""
    graphdef, state, abstract = abstract_model(config, dtype, matmul_precision)
    params = load_params(reader, abstract, ignore=checkpoint_ignore_patterns(config), progress=progress)
    return merge_params(graphdef, state, params)


def load_model(path, dtype="float32", *, converted_cache=None, progress: bool = True,
               matmul_precision: str | None = None):
    """Load a model from an HF checkpoint directory (or a Hugging Face Hub id), or from a directory `save_converted`
    wrote.

    `dtype` is the dtype of the params and activations (router weights stay float32). With `converted_cache`, the
    converted params are saved there with orbax after the first load and restored from there afterwards (the
    cache is keyed by nothing but its directory: point it at a fresh one for each checkpoint and dtype).

    `dtype` is also the compute precision: a float32 model runs its matmuls in full float32 on the GPU too (not
    TF32); `matmul_precision` overrides that (see jaxmodels.precision).
    """
    path = resolve_model_path(path)  # a Hub id -> its snapshot directory
    dtype = jnp.dtype(dtype)
    if converted_cache is not None and is_converted_dir(converted_cache):
        return _restore(converted_cache, dtype, matmul_precision)
    if is_converted_dir(path):
        return _restore(path, dtype, matmul_precision)
    raw_config = read_config_dict(path)
    config = load_config(raw_config)
    model = build_from_reader(config, open_checkpoint(path), dtype, progress=progress,
                              matmul_precision=matmul_precision)
    if converted_cache is not None:
        save_converted(model, converted_cache, raw_config)
    return model


def _restore(directory, dtype, matmul_precision=None):
    saved = jnp.dtype(converted_dtype(directory))
    if saved != dtype:
        raise ValueError(f"{directory} holds params converted to {saved}, not the requested {dtype}")
    config = load_config(directory)
    graphdef, state, abstract = abstract_model(config, dtype, matmul_precision)
    return merge_params(graphdef, state, restore_converted(directory, abstract))
