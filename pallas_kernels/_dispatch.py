"""Choosing between a Pallas kernel and its XLA reference."""

import jax

IMPLS = ("auto", "pallas", "xla")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_impl(impl: str, interpret: bool = False) -> str:
    """Return "pallas" or "xla" for a requested `impl`.

    `auto` picks the kernel on GPU; on CPU it picks the XLA reference unless `interpret=True` asks for the Pallas
    kernel in interpret mode (that is how CPU tests exercise the kernel bodies).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if (on_gpu() or interpret) else "xla"
    return impl


def dot_precision(dtype):
    """Matmul precision inside kernels: exact float32 for float32 operands, the native one otherwise.

    On the GPU a float32 dot defaults to TF32 (about 1e-3 relative); float32 models are run for parity with
    transformers, so their kernels must not silently drop to TF32.
    """
    return jax.lax.Precision.HIGHEST if jax.numpy.dtype(dtype) == jax.numpy.float32 else jax.lax.Precision.DEFAULT
