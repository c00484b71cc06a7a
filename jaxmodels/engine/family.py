"""Per-family step code the engine plugs in: an object with `params`, `cache_shapes(PoolSizes)`,
`extend(params, caches, batch)` and `decode(params, caches, batch)` (see nemotron_h_step.py)."""

from jaxmodels.engine.dsa_step import DSAStep
from jaxmodels.engine.nemotron_h_step import NemotronHStep

STEP_CLASSES = {"nemotron_h": NemotronHStep, "deepseek_v32": DSAStep, "glm_moe_dsa": DSAStep}


def step_for(model, **options):
    """The family's step object for `model`; `options` (e.g. matmul_precision, mamba_ssm_cache_dtype) go to its
    constructor."""
    model_type = model.config.model_type
    if model_type not in STEP_CLASSES:
        raise ValueError(f"the engine has no step functions for model_type {model_type!r}; "
                         f"supported: {sorted(STEP_CLASSES)}")
    return STEP_CLASSES[model_type](model, **options)
