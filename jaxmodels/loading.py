"""`load_model`: an HF checkpoint directory (or one we converted) -> an nnx model with its weights; `from_torch`: the
same from a transformers model already in memory."""

import dataclasses
import logging
import re

import jax.numpy as jnp

from bridge.checkpoint import CheckpointError, dict_reader, open_checkpoint
from bridge.converted import converted_dtype, is_converted_dir, restore_converted, save_converted
from bridge.loader import load_params
from bridge.rules import DEFAULT_RULES, renamed
from bridge.torch_interop import torch_to_numpy
from jaxmodels.configs import read_config_dict
from jaxmodels.families import abstract_model, load_config, model_class
from jaxmodels.hub import resolve_model_path
from jaxmodels.nnx_params import merge_params, model_params
from jaxmodels.quantization import check_mode, dequantized

log = logging.getLogger("jaxmodels")
# ModelOpt's FP8 KV-cache scales (see jaxmodels.configs.quantization): read past, the cache keeps the model's dtype.
KV_CACHE_SCALES = (r"\.k_proj\.k_scale$", r"\.v_proj\.v_scale$")


def checkpoint_ignore_patterns(config, *, load_mtp: bool = True) -> tuple[str, ...]:
    """Checkpoint tensors that exist but that the model does not use (regexes over normalized names): among them
    the MTP layers' copies of the target's embedding and LM head, or with `load_mtp=False` all of the MTP layers'
    tensors."""
    patterns = [r"rotary_emb\.inv_freq$"]
    if _has_kv_cache_scales(config):
        patterns += KV_CACHE_SCALES
    if getattr(config, "tie_word_embeddings", False):
        patterns.append(r"^lm_head\.weight$")
    model = model_class(config)
    for prefix in model.mtp_checkpoint_prefixes(config).values():
        if load_mtp:
            patterns += [f"^{re.escape(prefix + name)}$" for name in model.MTP_COPIES_OF_TARGET]
        else:
            patterns.append(f"^{re.escape(prefix)}")
    return tuple(patterns)


def _has_kv_cache_scales(config) -> bool:
    quantization = getattr(config, "quantization", None)
    return bool(quantization and quantization.kv_cache_scales)


def checkpoint_rules(config) -> tuple:
    """The bridge's rules, after one renaming rule per param prefix that checkpoints store under another name."""
    prefixes = model_class(config).mtp_checkpoint_prefixes(config)
    return (*(renamed(ours, theirs) for ours, theirs in prefixes.items() if ours != theirs), *DEFAULT_RULES)


def without_mtp(config):
    """`config` with no MTP layers: the model it builds has none."""
    return dataclasses.replace(config, num_nextn_predict_layers=0)


def built_config(raw_config: dict, *, load_mtp: bool, quantization) -> dict:
    """The HF config of the model `load_model` built from a checkpoint with `raw_config`: without the MTP layers it
    skipped, without the quantization it undid."""
    built = dict(raw_config)
    if not load_mtp:
        built["num_nextn_predict_layers"] = 0
    if quantization == "dequantize":
        built.pop("quantization_config", None)
    return built


def build_from_reader(config, reader, dtype, *, load_mtp: bool = True, progress: bool = True,
                      matmul_precision: str | None = None, quantization: str | None = None):
    """Build the model for `config` with the weights `reader` provides, checked strictly. `load_mtp=False` builds it
    without the MTP layers the config declares and skips their tensors. The layers an FP8 checkpoint quantizes keep
    their FP8 weights and scales, or with quantization="dequantize" become dense layers in `dtype`."""
    check_mode(quantization)
    ignore = checkpoint_ignore_patterns(config, load_mtp=load_mtp)
    if _has_kv_cache_scales(config):
        log.info("the checkpoint's FP8 KV-cache scales go unused: the KV cache keeps the model's dtype (%s)", dtype)
    if not load_mtp:
        config = without_mtp(config)
    graphdef, state, abstract = abstract_model(config, dtype, matmul_precision)
    try:
        params = load_params(reader, abstract, ignore=ignore, rules=checkpoint_rules(config), progress=progress)
    except CheckpointError as err:
        if not _lacks_mtp_tensors(err, config):
            raise
        raise CheckpointError(
            f"{err}\nThe config declares {config.num_nextn_predict_layers} multi-token-prediction layer(s) "
            "(num_nextn_predict_layers) whose tensors the checkpoint lacks; load_model(..., load_mtp=False) loads the "
            "model without them (it then cannot draft tokens for speculative decoding).", missing=err.missing) from err
    model = merge_params(graphdef, state, params)
    return dequantized(model) if quantization == "dequantize" else model


def _lacks_mtp_tensors(err: CheckpointError, config) -> bool:
    prefixes = tuple(model_class(config).mtp_checkpoint_prefixes(config).values())
    return bool(prefixes) and any(name.startswith(prefixes) for name in err.missing)


def load_model(path, dtype="float32", *, converted_cache=None, progress: bool = True,
               matmul_precision: str | None = None, load_mtp: bool = True, quantization: str | None = None):
    """Load a model from an HF checkpoint directory (or a Hugging Face Hub id), or from a directory `save_converted`
    wrote.

    `dtype` is the dtype of the params and activations (router weights stay float32). With `converted_cache`, the
    converted params are saved there with orbax after the first load and restored from there afterwards (the
    cache is keyed by nothing but its directory: point it at a fresh one for each checkpoint and dtype).

    `dtype` is also the compute precision: a float32 model runs its matmuls in full float32 on the GPU too (not
    TF32); `matmul_precision` overrides that (see jaxmodels.precision).

    The multi-token-prediction (MTP) layers the config declares (`num_nextn_predict_layers`), which draft tokens
    for speculative decoding, are loaded too, and a checkpoint that lacks their tensors is an error naming them;
    `load_mtp=False` builds the model without them and skips their tensors.

    An FP8 checkpoint (`quantization_config` in its config.json: DeepSeek-V3.2 / GLM-5 block-scaled, NVIDIA ModelOpt
    per-tensor) is served in FP8: its quantized layers keep their float8_e4m3fn weights and scales on the device, and
    their products quantize the activations on the fly (see jaxmodels.quantization); `dtype` is then the dtype of the
    activations and of the unquantized params. `quantization="dequantize"` converts those weights to `dtype` on load
    instead (for comparison, and where no FP8 GEMM is fast); on an unquantized checkpoint it changes nothing.
    """
    check_mode(quantization)
    path = resolve_model_path(path)  # a Hub id -> its snapshot directory
    dtype = jnp.dtype(dtype)
    if converted_cache is not None and is_converted_dir(converted_cache):
        return _restore(converted_cache, dtype, matmul_precision, load_mtp, quantization)
    if is_converted_dir(path):
        return _restore(path, dtype, matmul_precision, load_mtp, quantization)
    raw_config = read_config_dict(path)
    config = load_config(raw_config)
    model = build_from_reader(config, open_checkpoint(path), dtype, load_mtp=load_mtp, progress=progress,
                              matmul_precision=matmul_precision, quantization=quantization)
    if converted_cache is not None:
        # The converted directory's config describes the params it holds.
        save_converted(model_params(model), converted_cache,
                       built_config(raw_config, load_mtp=load_mtp, quantization=quantization), dtype=dtype)
    return model


def from_torch(hf_model, dtype=None, *, progress: bool = True):
    """Our model with the weights of a transformers `*ForCausalLM` already in memory (no disk round trip).

    `dtype` defaults to the torch model's dtype. transformers does not build MTP layers, so neither does this.
    """
    config = load_config(hf_model.config.to_dict())
    if dtype is None:
        dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    reader = dict_reader(dict(hf_model.state_dict()), f"in-memory {type(hf_model).__name__}", to_numpy=torch_to_numpy)
    return build_from_reader(config, reader, dtype, load_mtp=False, progress=progress)


def _restore(directory, dtype, matmul_precision=None, load_mtp: bool = True, quantization=None):
    saved = jnp.dtype(converted_dtype(directory))
    if saved != dtype:
        raise ValueError(f"{directory} holds params converted to {saved}, not the requested {dtype}")
    config = load_config(directory)
    graphdef, state, abstract = abstract_model(config, dtype, matmul_precision)
    params = restore_converted(directory, abstract)
    if not load_mtp:
        graphdef, state, abstract = abstract_model(without_mtp(config), dtype, matmul_precision)
    model = merge_params(graphdef, state, {path: params[path] for path in abstract})
    return dequantized(model) if quantization == "dequantize" else model
