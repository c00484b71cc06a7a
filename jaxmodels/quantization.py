"""Serving FP8 checkpoints: which linear layers an FP8 checkpoint quantizes, the model that holds them in FP8, and
its dense counterpart for `quantization="dequantize"`.

Which layers are quantized is published fact, kept here as data rather than as branches in the layers:
  * DeepSeek-V3.2 and GLM-5 quantize every linear projection (attention, indexer `wq_b` / `wk`, dense MLPs, shared and
    routed experts) but the LM head, the indexer's `weights_proj` (float32 in transformers, bf16 in the checkpoint)
    and the MTP layers' `eh_proj` (a plain bf16 linear in vLLM's and SGLang's MTP models). Routers, norms and
    embeddings are no linear layers here and stay as they are.
  * NVIDIA's ModelOpt checkpoints quantize every linear layer except those their config lists (the LM head among
    them); the Mamba conv1d is no linear layer.
Each model class lists the layers its family never quantizes in `FP8_UNQUANTIZED` (wildcards over our module
paths); a checkpoint's own list (`Fp8Config.unquantized`, over its module names, with or without the base-model
prefix) adds to it.

`with_fp8_weights` swaps the quantized layers of a freshly built (abstract) model for their FP8 forms, as
transformers' `replace_with_fp8_linear` does for torch; the bridge then fills them by name. With `quantize=True`
the FP8 layers take the dense layers' weights quantized instead (block-scaled only): the benchmark's FP8 model.
`dequantized` swaps them back into dense layers in the model dtype, the weights rounded once from w8 · scale.
"""

import fnmatch

from flax import nnx

from bridge.checkpoint import BASE_MODEL_PREFIXES
from jaxmodels.layers.fp8_linear import Fp8ExpertStack, Fp8Linear
from jaxmodels.layers.linear import linear
from jaxmodels.layers.moe import RoutedExperts

QUANTIZATION_MODES = (None, "dequantize")


def check_mode(quantization) -> None:
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")


def _matches(name: str, patterns) -> bool:
    """`name` is one of `patterns`: equal or a wildcard match, a module under it, or ending in it at a dot."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") or name.endswith("." + p)
               for p in patterns)


def _checkpoint_names(path: str, renames: dict[str, str]) -> list[str]:
    """The names a checkpoint may give our module `path`: renamed (MTP layers), with or without a base prefix."""
    for ours, theirs in renames.items():
        if path.startswith(ours):
            path = theirs + path[len(ours):]
            break
    return [path, *(prefix + path for prefix in BASE_MODEL_PREFIXES)]


def quantized_layers(model, config) -> list[tuple[tuple, nnx.Module]]:
    """(module path, module) of every linear layer and routed-expert stack `config`'s FP8 checkpoint quantizes."""
    family = type(model).FP8_UNQUANTIZED
    listed = config.quantization.unquantized
    renames = type(model).mtp_checkpoint_prefixes(config)
    chosen = []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, (nnx.Linear, RoutedExperts)):
            continue
        dotted = ".".join(str(part) for part in path)
        if _matches(dotted, family) or any(_matches(name, listed) for name in _checkpoint_names(dotted, renames)):
            continue
        chosen.append((path, module))
    return chosen


def _replace(model, path: tuple, new) -> None:
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def with_fp8_weights(model, config, *, quantize: bool = False):
    """`model` (just built, weights not loaded) with the layers `config.quantization` quantizes in FP8; unchanged
    for an unquantized checkpoint. `quantize=True`: the FP8 layers hold the dense layers' weights, quantized."""
    fp8 = config.quantization
    if fp8 is None:
        return model
    for path, module in quantized_layers(model, config):
        if isinstance(module, RoutedExperts):
            for name in module.projections():
                stack = getattr(module, name)
                num_experts, fan_in, fan_out = stack.shape
                layer = Fp8ExpertStack(num_experts, fan_in, fan_out, fp8=fp8, dtype=stack.dtype,
                                       axes=stack.get_metadata()["axes"])
                if quantize:
                    layer.set_quantized(stack[...])
                setattr(module, name, layer)
        else:
            layer = Fp8Linear(module.in_features, module.out_features, fp8=fp8,
                              axes=module.kernel.get_metadata()["axes"], bias=module.use_bias, dtype=module.dtype)
            if quantize:
                layer.set_quantized(module.kernel[...])
                if module.use_bias:
                    layer.bias.set_value(module.bias[...])
            _replace(model, path, layer)
    return model


def _dense_linear(layer: Fp8Linear) -> nnx.Linear:
    dense = nnx.eval_shape(lambda: linear(layer.in_features, layer.out_features, axes=layer.dense_axes,
                                          rngs=nnx.Rngs(0), bias=layer.bias is not None, dtype=layer.dtype))
    dense.kernel.set_value(layer.dequantized())
    if layer.bias is not None:
        dense.bias.set_value(layer.bias[...])
    return dense


def dequantized(model):
    """`model` with every FP8 layer replaced by its dense form in the model dtype (in place)."""
    for path, module in list(nnx.iter_modules(model)):
        if isinstance(module, Fp8Linear):
            _replace(model, path, _dense_linear(module))
        elif isinstance(module, RoutedExperts):
            for name in module.projections():
                stack = getattr(module, name)
                if isinstance(stack, Fp8ExpertStack):
                    setattr(module, name, nnx.Param(stack.dequantized(), axes=stack.dense_axes))
    return model
