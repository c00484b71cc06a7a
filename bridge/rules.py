"""Rules that say which checkpoint tensors make each of our params, and how.

Our modules mirror transformers' names, so one small rule set covers both families:
`*.kernel` is the transpose of the torch Linear's `*.weight`; `*.embedding` is the embedding's `*.weight`; the
Mamba conv weight drops torch's singleton axis; stacked experts come either stacked (transformers >= 5 layout,
[E, out, in]) or one tensor per expert (`experts.{j}.up_proj.weight`, the published layout), and gated experts
may come with gate and up fused (`experts.gate_up_proj`). Everything else keeps its name and shape.

Layers an FP8 checkpoint quantizes keep its tensors as they are (jaxmodels.layers.fp8_linear): `*.weight` [out, in]
and its scales under the same names, FP8 experts stacked from the per-expert tensors with no transpose. A scale
whose shape does not fit names its weight in the loader's error.
"""

import dataclasses
import re
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Checkpoint tensors (with the shapes they must have) and how to turn them into one param."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    assemble: Callable[[list[np.ndarray]], np.ndarray]
    # The inverse of `assemble`, for writing HF checkpoints: our param -> the checkpoint tensors, in `names` order.
    disassemble: Callable[[np.ndarray], list[np.ndarray]]
    note: str = ""  # what a shape mismatch should also say (a scale's weight)


Rule = Callable[[str, tuple[int, ...], object], TensorSource | None]

_EXPERT_PARAM = re.compile(r"^(?P<base>(.*\.)?experts)\.(?P<proj>gate_proj|up_proj|down_proj)$")
_FP8_EXPERT_TENSOR = re.compile(r"^(?P<base>(.*\.)?experts)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                                r"(?P<tensor>weight|weight_scale_inv|weight_scale|input_scale)$")
BLOCK_SCALE = "weight_scale_inv"


def linear_kernel(path, shape, reader):
    if path.endswith(".kernel") and len(shape) == 2:
        return TensorSource((path[: -len("kernel")] + "weight",), ((shape[1], shape[0]),), lambda a: a[0].T,
                            lambda p: [p.T])
    return None


def embedding(path, shape, reader):
    if path.endswith(".embedding"):
        return TensorSource((path[: -len("embedding")] + "weight",), (shape,), lambda a: a[0], lambda p: [p])
    return None


def depthwise_conv(path, shape, reader):
    if path.endswith("conv1d.weight") and len(shape) == 2:
        channels, kernel = shape
        return TensorSource((path,), ((channels, 1, kernel),), lambda a: a[0].reshape(channels, kernel),
                            lambda p: [p.reshape(channels, 1, kernel)])
    return None


def stacked_experts(path, shape, reader):
    match = _EXPERT_PARAM.match(path)
    if not match:
        return None
    num_experts, fan_in, fan_out = shape
    if path in reader:
        return TensorSource((path,), ((num_experts, fan_out, fan_in),), lambda a: a[0].transpose(0, 2, 1),
                            lambda p: [p.transpose(0, 2, 1)])
    names = tuple(f"{match['base']}.{j}.{match['proj']}.weight" for j in range(num_experts))
    return TensorSource(names, ((fan_out, fan_in),) * num_experts, lambda arrays: np.stack([a.T for a in arrays]),
                        lambda p: [expert.T for expert in p])


def fused_gate_up_experts(path, shape, reader):
    """Gated experts whose gate and up projections are fused in one tensor `experts.gate_up_proj` [E, 2·inter, in]
    (gate rows first): the layout of transformers' in-memory DeepSeek-V3.2 / GLM-5 modules. `save_pretrained`
    splits it back into per-expert tensors, which `stacked_experts` reads."""
    match = _EXPERT_PARAM.match(path)
    if not match or match["proj"] == "down_proj" or f"{match['base']}.gate_up_proj" not in reader:
        return None
    num_experts, fan_in, inter = shape
    half = slice(0, inter) if match["proj"] == "gate_proj" else slice(inter, 2 * inter)

    def write_back(param):
        raise ValueError(f"{path}: the fused gate_up_proj layout is read-only; write per-expert tensors instead")

    return TensorSource((f"{match['base']}.gate_up_proj",), ((num_experts, 2 * inter, fan_in),),
                        lambda a: a[0][:, half].transpose(0, 2, 1), write_back)


def _scale_note(scale_name: str, reader) -> str:
    """Where a block scale's shape comes from: its weight, as the checkpoint has it."""
    weight = scale_name[: -len(BLOCK_SCALE)] + "weight"
    found = f", shape {tuple(reader.shape(weight))} in the checkpoint" if weight in reader else ""
    return f"one scale per block of its weight {weight}{found}"


def block_scale(path, shape, reader):
    if path.endswith("." + BLOCK_SCALE):
        return TensorSource((path,), (shape,), lambda a: a[0], lambda p: [p], note=_scale_note(path, reader))
    return None


def fp8_experts(path, shape, reader):
    """An FP8 expert stack's weight [E, out, in] or scales [E, ...]: the published per-expert tensors, stacked."""
    match = _FP8_EXPERT_TENSOR.match(path)
    if not match:
        return None
    names = tuple(f"{match['base']}.{j}.{match['proj']}.{match['tensor']}" for j in range(shape[0]))
    note = _scale_note(names[0], reader) + " (and of each expert's)" if match["tensor"] == BLOCK_SCALE else ""
    return TensorSource(names, (tuple(shape[1:]),) * shape[0], np.stack, list, note=note)


def same_name(path, shape, reader):
    return TensorSource((path,), (shape,), lambda a: a[0], lambda p: [p])


DEFAULT_RULES: tuple[Rule, ...] = (linear_kernel, embedding, depthwise_conv, fused_gate_up_experts, stacked_experts,
                                   fp8_experts, block_scale, same_name)


def renamed(param_prefix: str, checkpoint_prefix: str, rules: tuple[Rule, ...] = DEFAULT_RULES) -> Rule:
    """A rule for the params under `param_prefix` whose tensors the checkpoint keeps under `checkpoint_prefix`
    (DeepSeek's MTP layers, which checkpoints number on after the decoder layers): `rules` on the renamed path."""
    def rule(path, shape, reader):
        if not path.startswith(param_prefix):
            return None
        return source_for(checkpoint_prefix + path[len(param_prefix):], shape, reader, rules)

    return rule


def source_for(path: str, shape: tuple[int, ...], reader, rules=DEFAULT_RULES) -> TensorSource:
    for rule in rules:
        source = rule(path, shape, reader)
        if source is not None:
            return source
    raise AssertionError("the rule list must end with a catch-all rule")
