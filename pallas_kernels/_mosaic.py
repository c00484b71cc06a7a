"""What the Mosaic GPU kernels share: the module, imported where a kernel is built (some jax builds lack it), what
this jax can do with it, and a load with a layout that runs on both jax versions the project supports."""

from __future__ import annotations

import functools
import inspect


def mosaic_gpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


def mosaic_lowering_available() -> bool:
    """Pallas' Mosaic GPU backend with warp-specialized pipelines, which lowers the kernels for a GPU from any
    machine (`jax.export`): jax 0.10 has it too."""
    try:
        plgpu = mosaic_gpu()
    except ImportError:
        return False
    return hasattr(plgpu, "emit_pipeline_warp_specialized")


def mosaic_kernels_available() -> bool:
    """The Mosaic GPU kernels run, compiled or in Mosaic GPU's interpreter (jax >= 0.11). jax 0.10 lowers them but
    does not export its interpreter, whose version there has no rule for `plgpu.load` or `plgpu.layout_cast` and
    never finished the warp-specialized pipeline when tried (2026-12-04)."""
    return mosaic_lowering_available() and hasattr(mosaic_gpu(), "InterpretGPUParams")


def interpret_params(**options):
    """Mosaic GPU's interpreter's parameters (`InterpretGPUParams`: `detect_races`, `uninitialized_memory`, ...),
    which jax 0.11 exports from `plgpu` and jax 0.10 keeps in its private modules."""
    plgpu = mosaic_gpu()
    if hasattr(plgpu, "InterpretGPUParams"):
        return plgpu.InterpretGPUParams(**options)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**options)


@functools.cache
def _load_takes_an_index() -> bool:
    return inspect.signature(mosaic_gpu().load).parameters["idx"].default is inspect.Parameter.empty


def load_with_layout(ref, layout):
    """`plgpu.load(ref, layout=layout)` of the whole ref: jax 0.10 requires the index argument, which jax 0.11
    deprecates (the ref is indexed with `.at[...]` instead)."""
    plgpu = mosaic_gpu()
    return plgpu.load(ref, (), layout=layout) if _load_takes_an_index() else plgpu.load(ref, layout=layout)
