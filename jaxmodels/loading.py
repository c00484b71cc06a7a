"""`load_model`: an HF checkpoint directory (or one we converted) -> an nnx model with its weights; `from_torch`: the
same from a transformers model already in memory."""

import jax.numpy as jnp

from bridge.checkpoint import dict_reader, open_checkpoint
from bridge.converted import converted_dtype, is_converted_dir, restore_converted, save_converted
from bridge.loader import load_params
from bridge.torch_interop import torch_to_numpy
from jaxmodels.configs import read_config_dict
from jaxmodels.families import abstract_model, load_config
from jaxmodels.hub import resolve_model_path
from jaxmodels.nnx_params import merge_params, model_params


def checkpoint_ignore_patterns(config) -> tuple[str, ...]:
    """Checkpoint tensors that exist but that the model does not use (regexes over normalized names)."""
    patterns = [r"rotary_emb\.inv_freq$"]
    if getattr(config, "tie_word_embeddings", False):
        patterns.append(r"^lm_head\.weight$")
    # Multi-token-prediction heads (`mtp.*` in Nemotron-H) serve speculative decoding, which transformers does not
    # load either; they are skipped until the engine grows speculative decoding.
    patterns.append(r"^mtp\.")
    # DeepSeek / GLM checkpoints append theirs as extra decoder layers after the last real one.
    num_mtp = getattr(config, "num_nextn_predict_layers", 0)
    if num_mtp and config.model_type in ("deepseek_v32", "glm_moe_dsa"):
        first = config.num_hidden_layers
        patterns.append(rf"^layers\.({'|'.join(str(first + i) for i in range(num_mtp))})\.")
    return tuple(patterns)


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
        save_converted(model_params(model), converted_cache, raw_config, dtype=dtype)
    return model


def from_torch(hf_model, dtype=None, *, progress: bool = True):
    """Our model with the weights of a transformers `*ForCausalLM` already in memory (no disk round trip).

    `dtype` defaults to the torch model's dtype.
    """
    config = load_config(hf_model.config.to_dict())
    if dtype is None:
        dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    reader = dict_reader(dict(hf_model.state_dict()), f"in-memory {type(hf_model).__name__}", to_numpy=torch_to_numpy)
    return build_from_reader(config, reader, dtype, progress=progress)


def _restore(directory, dtype, matmul_precision=None):
    saved = jnp.dtype(converted_dtype(directory))
    if saved != dtype:
        raise ValueError(f"{directory} holds params converted to {saved}, not the requested {dtype}")
    config = load_config(directory)
    graphdef, state, abstract = abstract_model(config, dtype, matmul_precision)
    return merge_params(graphdef, state, restore_converted(directory, abstract))
