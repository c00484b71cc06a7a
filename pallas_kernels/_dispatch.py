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
