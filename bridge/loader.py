"""Strict loading of checkpoint tensors into a model's params.

The whole checkpoint is checked against the model before any weight is read: every param must find its tensors,
each with the expected shape, and every checkpoint tensor must be used (or match an ignore pattern). All problems
are reported together in one `CheckpointError` naming each tensor and both shapes.
"""

import re

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from bridge.checkpoint import CheckpointError
from bridge.rules import DEFAULT_RULES, source_for

_MAX_LISTED = 20
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _listing(items: list[str]) -> str:
    shown = "\n  ".join(items[:_MAX_LISTED])
    more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"\n  {shown}{more}"


def plan_sources(reader, abstract: dict, *, ignore=(), rules=DEFAULT_RULES) -> dict:
    """Map each param path to its `TensorSource`, or raise `CheckpointError` listing every mismatch."""
    plan, missing, missing_names, misshaped, used = {}, [], [], [], set()
    for path, leaf in abstract.items():
        source = source_for(path, tuple(leaf.shape), reader, rules)
        plan[path] = source
        for name, expected in zip(source.names, source.shapes):
            used.add(name)
            if name not in reader:
                missing_names.append(name)
                missing.append(f"{name} (for param {path}, expected shape {expected})")
            elif tuple(reader.shape(name)) != tuple(expected):
                note = f": {source.note}" if source.note else ""
                misshaped.append(f"{name}: checkpoint shape {tuple(reader.shape(name))}, model expects {expected} "
                                 f"(param {path}){note}")
    ignore_re = [re.compile(p) for p in ignore]
    unexpected = sorted(n for n in reader.names() if n not in used and not any(p.search(n) for p in ignore_re))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the checkpoint:{_listing(missing)}")
    if misshaped:
        problems.append(f"{len(misshaped)} tensor(s) with the wrong shape:{_listing(misshaped)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) the model has no place for:{_listing(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {reader.source} does not match the model:\n" + "\n".join(problems),
                              missing=missing_names)
    return plan


def load_params(reader, abstract: dict, *, ignore=(), rules=DEFAULT_RULES, progress: bool = True,
                place=jax.device_put) -> dict:
    """Read, reshape and cast every param.

    `abstract` maps dotted param paths to `ShapeDtypeStruct`s; the result maps the same paths to `place(array)`
    (by default a device put; a sharded loader passes its own placement).
    """
    plan = plan_sources(reader, abstract, ignore=ignore, rules=rules)
    params = {}
    for path in tqdm(plan, desc="Loading weights", unit="tensor", disable=not progress, leave=False):
        source = plan[path]
        array = np.asarray(source.assemble([reader.read(name) for name in source.names]))
        _check_fp8(array.dtype, np.dtype(abstract[path].dtype), source.names, reader.source)
        params[path] = place(array.astype(abstract[path].dtype, copy=False))
    return params


def _check_fp8(stored, expected, names, source) -> None:
    """FP8 values mean nothing without their scales: they load only into FP8 params, and those only from FP8."""
    if (stored == FP8) != (expected == FP8):
        raise CheckpointError(f"checkpoint {source}: {names[0]} holds {stored} values where the model expects "
                              f"{expected}: FP8 values load only into the FP8 layers the checkpoint's "
                              "quantization_config declares, and those only from FP8 values")
