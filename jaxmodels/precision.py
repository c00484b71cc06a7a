"""Matmul precision: a model's dtype is its compute precision, on every platform.

XLA's default precision for a float32 dot is exact on the CPU but TF32 on NVIDIA GPUs (about 1e-3 relative), while
torch keeps float32 matmuls in float32. So a `float32` model runs every XLA dot and einsum at HIGHEST precision,
set explicitly at each entry point (the model's forward and the engine's step executables) rather than left to a
global flag a user may have set otherwise. `bfloat16` models keep the fast default. `matmul_precision=` on
`load_model` / `LLM` overrides the choice (e.g. "tensorfloat32" for float32 weights at TF32 speed).

Pallas kernels choose their own dot precision from their operands (`pallas_kernels._dispatch.dot_precision`), and
a few small float32 products (MoE router logits, indexer head weights) are HIGHEST whatever the model dtype, as
transformers computes them in float32.
"""

import jax
import jax.numpy as jnp

# The names jax.default_matmul_precision accepts.
MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32", "bfloat16_3x",
                     "tensorfloat32_3x")


def matmul_precision_for(dtype, override: str | None = None) -> str:
    """The precision a model of `dtype` computes at: `override` if given, else "highest" for float32 and
    "default" otherwise."""
    if override is not None:
        if override not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {MATMUL_PRECISIONS} or None, got {override!r}")
        return override
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


def precision_scope(precision: str):
    """Context manager under which XLA dots and einsums without an explicit precision use `precision`."""
    return jax.default_matmul_precision(precision)
