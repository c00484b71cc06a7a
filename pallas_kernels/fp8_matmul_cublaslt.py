"""Block-scaled FP8 GEMM through cuBLASLt's own block scaling (NVIDIA GPUs with cuBLAS >= 12.9, Hopper and later).

`fp8_block_matmul_cublaslt(x8[M, K], x_scale[M, ⌈K/128⌉], w8[N, K], w_scale[⌈N/128⌉, ⌈K/128⌉]) -> [M, N]`, the
operands of `fp8_matmul_pallas.fp8_block_matmul` with (128, 128) weight blocks: DeepSeek's recipe, which cuBLASLt
runs natively since 12.9 (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F` for the weight,
`..._VEC128_32F` for the activations, one float32 scale per token and 128 channels).

XLA has no block-scaled FP8 dot on Hopper, so the library is called from a `jax.experimental.buffer_callback` (jax
0.10 and 0.11 have it) through ctypes: the callback gets the device pointers and XLA's stream and enqueues one
`cublasLtMatmul`; with `command_buffer=True` it runs while XLA records the step's CUDA graph, and replays run the
recorded GEMM (XLA records again when the buffers' addresses change, which calls the Python again). The library is
the one XLA loaded (found in /proc/self/maps), so nothing is built or installed.

In cuBLASLt's column-major terms the product is yᵀ[N, M] = op(A)·B with A = w8 (stored [N][K], op = T) and B = x8
(stored [M][K], op = N), which is y[M, N] row-major. The scale layouts it takes (the ones torch's `_scaled_mm` hands
it for BlockWise128x128 x BlockWise1x128): the weight's [⌈N/128⌉][⌈K/128⌉] as the checkpoint stores it, its K-block
count padded to a multiple of 4; the activations' transposed, [⌈K/128⌉][M], M padded to a multiple of 4 (the rows of
x8 with it).
"""

from __future__ import annotations

import ctypes
import threading

import jax
import jax.numpy as jnp

# Enum values of cublasLt.h and library_types.h (CUDA 12.9 - 13.x).
_COMPUTE_32F = 68
_DATA_TYPES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 14, jnp.dtype(jnp.float16): 2}
_R_8F_E4M3 = 28
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F, _SCALE_BLK128X128_32F = 4, 5
_PREF_MAX_WORKSPACE_BYTES = 1
_PLACEHOLDER_POINTER = 1 << 20

BLOCK = 128
ROW_MULTIPLE = 4  # rows of x8 (and of its transposed scales) padded to this
SCALE_BLOCKS_MULTIPLE = 4  # K blocks of the weight's scales padded to this
WORKSPACE_BYTES = 32 << 20  # what NVIDIA suggests for Hopper; split-K algorithms use it


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_cublaslt_path() -> str | None:
    """The libcublasLt XLA's GPU backend loaded into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        pass
    return None


class _Library:
    """ctypes bindings of the few cuBLASLt functions used, one handle per process."""

    def __init__(self):
        path = _loaded_cublaslt_path()
        candidates = [path] if path else ["libcublasLt.so.13", "libcublasLt.so.12"]
        errors = []
        for name in candidates:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            raise RuntimeError(f"cuBLASLt could not be loaded ({'; '.join(errors)})")
        lib, vp, sz = self.lib, ctypes.c_void_p, ctypes.c_size_t
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                       ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
        self.handle = vp()
        self.check("cublasLtCreate", lib.cublasLtCreate(ctypes.byref(self.handle)))

    @staticmethod
    def check(what: str, status: int) -> None:
        if status:
            raise RuntimeError(f"{what} failed with cublasStatus_t {status}")

    def set_desc(self, desc, attribute: int, value) -> None:
        self.check(f"cublasLtMatmulDescSetAttribute({attribute})", self.lib.cublasLtMatmulDescSetAttribute(
            desc, attribute, ctypes.byref(value), ctypes.sizeof(value)))

    def layout(self, data_type: int, rows: int, cols: int, ld: int):
        out = ctypes.c_void_p()
        self.check("cublasLtMatrixLayoutCreate", self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(out), data_type, rows, cols, ld))
        return out


_LIBRARY: _Library | None = None
_LIBRARY_LOCK = threading.Lock()


def _library() -> _Library:
    global _LIBRARY
    with _LIBRARY_LOCK:
        if _LIBRARY is None:
            _LIBRARY = _Library()
        return _LIBRARY


class _Plan:
    """The descriptors and the heuristic's algorithm of one (rows, N, K, out dtype); descriptors live as long as
    the process (a few per linear shape)."""

    def __init__(self, rows: int, n: int, k: int, out_dtype):
        lt = self.lt = _library()
        self.desc = ctypes.c_void_p()
        lt.check("cublasLtMatmulDescCreate", lt.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F,
                                                                            _DATA_TYPES[jnp.dtype(jnp.float32)]))
        lt.set_desc(self.desc, _DESC_TRANSA, ctypes.c_int(_OP_T))
        lt.set_desc(self.desc, _DESC_TRANSB, ctypes.c_int(_OP_N))
        lt.set_desc(self.desc, _DESC_A_SCALE_MODE, ctypes.c_int(_SCALE_BLK128X128_32F))
        lt.set_desc(self.desc, _DESC_B_SCALE_MODE, ctypes.c_int(_SCALE_VEC128_32F))
        # The heuristic rejects block scale modes without scale pointers (cublasStatus_t 7, cuBLASLt 13.1); any
        # aligned placeholder will do, `run` sets the call's own.
        lt.set_desc(self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(_PLACEHOLDER_POINTER))
        lt.set_desc(self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(_PLACEHOLDER_POINTER))
        self.a = lt.layout(_R_8F_E4M3, k, n, k)
        self.b = lt.layout(_R_8F_E4M3, k, rows, k)
        self.d = lt.layout(_DATA_TYPES[jnp.dtype(out_dtype)], n, rows, n)
        preference = ctypes.c_void_p()
        lt.check("cublasLtMatmulPreferenceCreate", lt.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)))
        workspace = ctypes.c_size_t(WORKSPACE_BYTES)
        lt.check("cublasLtMatmulPreferenceSetAttribute", lt.lib.cublasLtMatmulPreferenceSetAttribute(
            preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace), ctypes.sizeof(workspace)))
        self.result, found = _HeuristicResult(), ctypes.c_int(0)
        lt.check("cublasLtMatmulAlgoGetHeuristic", lt.lib.cublasLtMatmulAlgoGetHeuristic(
            lt.handle, self.desc, self.a, self.b, self.d, self.d, preference, 1, ctypes.byref(self.result),
            ctypes.byref(found)))
        if not found.value:
            raise RuntimeError(f"cuBLASLt has no block-scaled FP8 algorithm for rows={rows} N={n} K={k} "
                               f"out {jnp.dtype(out_dtype).name} on this GPU")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.lock = threading.Lock()

    def run(self, stream: int, x8: int, x_scale: int, w8: int, w_scale: int, out: int, workspace: int) -> None:
        lt = self.lt
        with self.lock:  # the scale pointers live in the shared descriptor until the call is enqueued
            lt.set_desc(self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale))
            lt.set_desc(self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale))
            lt.check("cublasLtMatmul", lt.lib.cublasLtMatmul(
                lt.handle, self.desc, ctypes.byref(self.alpha), w8, self.a, x8, self.b, ctypes.byref(self.beta),
                out, self.d, out, self.d, ctypes.byref(self.result.algo), workspace, WORKSPACE_BYTES, stream))


_PLANS: dict = {}
_PLANS_LOCK = threading.Lock()


def _plan(rows: int, n: int, k: int, out_dtype) -> _Plan:
    """One plan per shape, also when several devices' callbacks ask at once."""
    with _PLANS_LOCK:
        key = (rows, n, k, jnp.dtype(out_dtype))
        if key not in _PLANS:
            _PLANS[key] = _Plan(rows, n, k, out_dtype)
        return _PLANS[key]


def _pointer(buffer) -> int:
    return buffer.__cuda_array_interface__["data"][0]


def _gemm_callback(ctx, outs, x8, x_scale, w8, w_scale):
    if ctx.stage.name != "EXECUTE":  # the only stage the H200 runs showed; any other has no stream to run on
        return
    out, workspace = outs
    rows, n = out.shape
    _plan(rows, n, x8.shape[1], jnp.dtype(out.dtype)).run(
        ctx.stream, _pointer(x8), _pointer(x_scale), _pointer(w8), _pointer(w_scale), _pointer(out),
        _pointer(workspace))


def laid_out_scales(x_scale, w_scale, rows: int):
    """(x_scale [M, kb] -> [kb, rows] with rows >= M zero-padded, w_scale [nb, kb] -> [nb, kb padded to 4])."""
    M, kb = x_scale.shape
    xs = jnp.pad(x_scale.astype(jnp.float32), ((0, rows - M), (0, 0))).T
    ws = jnp.pad(w_scale.astype(jnp.float32), ((0, 0), (0, -kb % SCALE_BLOCKS_MULTIPLE)))
    return xs, ws


def cublaslt_problem(n: int, k: int, block) -> str | None:
    """Why cuBLASLt's block-scaled GEMM cannot take these shapes (16-byte aligned rows, 128 x 128 blocks)."""
    if tuple(block or ()) != (BLOCK, BLOCK):
        return f"cuBLASLt block scaling takes (128, 128) blocks, got {block}"
    if k % 16 or n % 16:
        return f"cuBLASLt FP8 needs N and K multiples of 16, got N={n} K={k}"
    return None


def fp8_block_matmul_cublaslt(x8, x_scale, w8, w_scale, *, out_dtype=jnp.bfloat16, command_buffer: bool = True):
    """y[M, N] = (x8 · x_scale per 128 channels) @ (w8 · w_scale per 128 x 128 block)ᵀ on cuBLASLt (GPU only);
    out_dtype float32, bfloat16 or float16. `command_buffer=False` keeps the call out of XLA's CUDA graphs."""
    M, K = x8.shape
    N = w8.shape[0]
    problem = cublaslt_problem(N, K, (BLOCK, BLOCK))
    if problem:
        raise ValueError(problem)
    rows = -(-M // ROW_MULTIPLE) * ROW_MULTIPLE
    xs, ws = laid_out_scales(x_scale, w_scale, rows)
    x8 = jnp.pad(x8, ((0, rows - M), (0, 0)))
    from jax.experimental.buffer_callback import buffer_callback

    call = buffer_callback(_gemm_callback, (jax.ShapeDtypeStruct((rows, N), out_dtype),
                                            jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8)),
                           command_buffer_compatible=command_buffer)
    # As bytes: the callback's buffers know no float8 (`__cuda_array_interface__` raises for F8E4M3FN).
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)  # noqa: E731
    out, _ = call(as_bytes(x8), xs, as_bytes(w8), ws)
    return out[:M]
