"""Choosing between a Pallas kernel and its XLA reference."""

import functools
import logging
import os

import jax
import jax.numpy as jnp
from jax import lax

log = logging.getLogger("pallas_kernels")

IMPLS = ("auto", "pallas", "xla")
# Pallas' Triton lowering computes a ref's element offsets in 32-bit integers unless the array is larger than 2^32
# bytes (jax/_src/pallas/triton/lowering.py, `_compute_offsets_from_indices`): an array of 1-byte elements between
# 2^31 and 2^32 elements is addressed with offsets that overflow (on the H200: an illegal address in the FP8 grouped
# GEMM, other keys selected by the DSA indexer over its FP8 key pool). Arrays of 2-byte or wider elements pass 2^32
# bytes, and switch to 64-bit offsets, before their offsets reach 2^31. The FP8 GEMMs and the indexer's logits kernel
# take such operands as byte pairs (below; tests/pallas_kernels/test_large_pools.py, passed on the H200 on
# 2026-12-01), so the engine's 1-byte cache pools (the DSA indexer's FP8 keys) may take any size.
MAX_BYTE_ELEMENTS = 2**31 - 1


def needs_byte_pairs(*operands) -> bool:
    """Whether a 1-byte operand is too large for 32-bit element offsets yet small enough to get no 64-bit ones
    (MAX_BYTE_ELEMENTS)."""
    return any(a.dtype.itemsize == 1 and MAX_BYTE_ELEMENTS < a.size <= 2**32 for a in operands)


def as_byte_pairs(a: jax.Array) -> jax.Array:
    """e4m3 [..., K] (K even) -> uint16 [..., K/2], channel 2j in the low byte of pair j: a bitcast, no copy."""
    return lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2), jnp.uint16)


def split_byte_pairs(pairs):
    """uint16 tile -> (e4m3 of its low bytes, e4m3 of its high bytes): the even and the odd channels."""
    as_e4m3 = functools.partial(lax.bitcast_convert_type, new_dtype=jnp.float8_e4m3fn)
    return as_e4m3((pairs & 0xFF).astype(jnp.uint8)), as_e4m3((pairs >> 8).astype(jnp.uint8))


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def gpu_capability() -> tuple[int, int] | None:
    """The first device's CUDA compute capability as (major, minor): (9, 0) on the H200; None off the GPU or where
    the device does not say (then the kernels' choices stay those made for the H200)."""
    if not on_gpu():
        return None
    try:
        major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def is_hopper() -> bool:
    """Whether the GPU is a Hopper (compute capability 9.x; unknown counts as one): the Mosaic GPU kernels use its
    wgmma instructions and cuBLASLt's 128 x 128 block-scaled FP8 GEMM was measured there; Blackwell has neither
    wgmma nor our measurements."""
    capability = gpu_capability()
    return capability is None or capability[0] == 9


# Shared memory one program (thread block) may take, in KiB, by compute capability (CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"): V100 96, T4 64, A100 163, RTX 30 / A10 / L40S / RTX 40 99,
# Orin 163, H100 / H200 227, B200 227, RTX 50 99. Other known GPUs get the least of these recent ones.
_SHARED_MEMORY_KIB = {(7, 0): 96, (7, 5): 64, (8, 0): 163, (8, 6): 99, (8, 7): 163, (8, 9): 99, (9, 0): 227,
                      (10, 0): 227, (12, 0): 99}
# What the kernels' pipelines (num_stages) were sized for: the H200's.
HOPPER_SHARED_MEMORY = _SHARED_MEMORY_KIB[(9, 0)] * 1024


def shared_memory_per_program() -> int:
    """Bytes of shared memory one program may take on this GPU (the H200's where the device does not say)."""
    capability = gpu_capability()
    if capability is None:
        return HOPPER_SHARED_MEMORY
    return _SHARED_MEMORY_KIB.get(capability, 99) * 1024


def fit_stages(stages: int, stage_bytes: int, other_bytes: int = 8 * 1024) -> int:
    """The most pipeline stages, at most `stages` and at least 1, whose buffers (`stage_bytes` each, plus
    `other_bytes` for the rest of the program's shared memory) fit in `shared_memory_per_program`. The kernels' default
    stages were sized for the H200's 227 KiB (the sparse MLA prefill tiles take 216 KiB there); Triton refuses to
    compile a pipeline that does not fit, as on an A100 (163 KiB) or an Ada GPU (99 KiB). Unmeasured off the H200: it
    keeps such GPUs compiling, not fast."""
    budget = shared_memory_per_program()
    while stages > 1 and stages * stage_bytes + other_bytes > budget:
        stages -= 1
    return stages


def lacks_fp8_tensor_cores() -> bool:
    """A GPU below compute capability 8.9 (Ampere and older): no e4m3 MMA, no e4m3 type in Triton, no FP8 GEMM in
    cuBLASLt."""
    capability = gpu_capability()
    return capability is not None and capability < (8, 9)


def fp8_problem(*operands) -> str | None:
    """Why a Triton kernel cannot take these float8 operands on this GPU (`lacks_fp8_tensor_cores`), or None."""
    if lacks_fp8_tensor_cores() and any(jnp.dtype(a.dtype) in (jnp.float8_e4m3fn, jnp.float8_e5m2) for a in operands):
        major, minor = gpu_capability()
        return f"float8 operands need compute capability 8.9 or newer, this GPU has {major}.{minor}"
    return None


def num_sms() -> int:
    """The first device's streaming multiprocessors, or the H200's 132 where the device does not say (the CPU):
    the kernels' grid defaults were tuned there."""
    return getattr(jax.devices()[0], "core_count", None) or 132


# Kernels (by the names `resolve_impl` is given, which are also their names in profiles) that `auto` sends to their
# XLA reference: comma-separated, or "all". For A/B runs of a kernel inside the engine and for telling a kernel's
# fault from the model's; read when a program is traced.
XLA_KERNELS_ENV = "JAXMODELS_XLA_KERNELS"


def xla_by_request(kernel: str) -> bool:
    """Whether $JAXMODELS_XLA_KERNELS names `kernel` (or is "all")."""
    names = {name.strip() for name in os.environ.get(XLA_KERNELS_ENV, "").split(",")}
    return kernel in names or "all" in names


def resolve_impl(impl: str, interpret: bool = False, unsupported: str | None = None,
                 kernel: str = "kernel") -> str:
    """Return "pallas" or "xla" for a requested `impl`.

    `auto` picks the kernel on GPU; on CPU it picks the XLA reference unless `interpret=True` asks for the Pallas
    kernel in interpret mode (that is how CPU tests exercise the kernel bodies). A kernel that $JAXMODELS_XLA_KERNELS
    names runs its XLA reference under `auto` everywhere.

    `unsupported` is the kernel's reason why the compiled (Triton) kernel cannot take these shapes, or None: Triton
    needs power-of-two tiles of at least 16 along matmul dimensions, which real model shapes meet and tiny test
    models often do not. Then `auto` runs the XLA reference (logged once per kernel and reason, at debug level) and
    `pallas` raises. Interpret mode has no such limits.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto" and xla_by_request(kernel):
        return "xla"
    choice = ("pallas" if (on_gpu() or interpret) else "xla") if impl == "auto" else impl
    if choice == "pallas" and unsupported and not interpret:
        if impl == "auto":
            _log_fallback(kernel, unsupported)
            return "xla"
        raise ValueError(f"the Pallas {kernel} cannot compile these shapes: {unsupported}; use impl='auto' or 'xla'")
    return choice


@functools.lru_cache(maxsize=None)
def _log_fallback(kernel: str, reason: str) -> None:
    log.debug("%s: running the XLA reference (%s)", kernel, reason)


def first_problem(*problems: str | None) -> str | None:
    """The first of several shape checks that failed, or None."""
    return next((p for p in problems if p), None)


def pow2_tile_problem(name: str, size: int, minimum: int = 16) -> str | None:
    """Why `size` cannot be a Triton matmul tile dimension (None when it can)."""
    if size < minimum or size & (size - 1):
        return f"{name}={size} is not a power of two >= {minimum}"
    return None


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton tiles are powers of two, padded up by masks."""
    return 1 << max(int(n) - 1, 0).bit_length()


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two that divides `n` and is at most `cap`."""
    return min(n & -n, cap)


def dot_precision(dtype):
    """Matmul precision inside kernels: exact float32 for float32 operands, the native one otherwise.

    On the GPU a float32 dot defaults to TF32 (about 1e-3 relative); float32 models are run for parity with
    transformers, so their kernels must not silently drop to TF32.
    """
    return jax.lax.Precision.HIGHEST if jax.numpy.dtype(dtype) == jax.numpy.float32 else jax.lax.Precision.DEFAULT
