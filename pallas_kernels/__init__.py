"""Pallas kernels with their XLA references. Every kernel takes `impl="auto" | "pallas" | "xla"` and `interpret=`.

`impl="auto"` runs the Pallas kernel on a GPU and the XLA reference elsewhere (see `_dispatch.resolve_impl`).
"""
