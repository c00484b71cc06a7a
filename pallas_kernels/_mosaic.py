"""What the Mosaic GPU kernels share: the module, imported where a kernel is built (some jax builds lack it), and a
load with a layout that runs on both jax versions the project supports."""

from __future__ import annotations

import functools
import inspect


def mosaic_gpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


@functools.cache
def _load_takes_an_index() -> bool:
    return inspect.signature(mosaic_gpu().load).parameters["idx"].default is inspect.Parameter.empty


def load_with_layout(ref, layout):
    """`plgpu.load(ref, layout=layout)` of the whole ref: jax 0.10 requires the index argument, which jax 0.11
    deprecates (the ref is indexed with `.at[...]` instead)."""
    plgpu = mosaic_gpu()
    return plgpu.load(ref, (), layout=layout) if _load_takes_an_index() else plgpu.load(ref, layout=layout)
