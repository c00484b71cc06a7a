"""FP8 GEMMs on the GPU: the block-scaled Pallas kernels and the per-tensor XLA FP8 dot against bf16 at the same
shapes, with the XLA FP8 dot as the cuBLASLt ceiling.

    PYTHONPATH=. python bench/fp8_kernels.py [--check] [--sweep] [--log FILE]
    PYTHONPATH=. python bench/fp8_kernels.py --interpret --check --sweep     # CPU smoke run on tiny shapes

Sections:
  * check (--check): compiled kernels against the XLA reference (dequantize, one float32 HIGHEST dot), float32
    outputs; max |error| / max |ref| must stay below 1e-3: Hopper's FP8 MMA keeps about 14 bits while it sums a
    128-term K block (DeepSeek-V3 report §3.3.2), which leaves ~1e-4 here, and a wrong scale block errs by ~1e-1.
    The Mosaic kernel (jax >= 0.11) is checked with each of MOSAIC_CHECKS (without clusters and with pairs); one
    that fails to compile fails its check. Exits non-zero on failure.
  * dense: x[M, 7168] @ w[18432, 7168]ᵀ (DeepSeek's dense-MLP up projection) at M = 4096, 128, 16: bf16 `jnp.dot`
    with w as [K, N] and with the checkpoint's [N, K] layout, the XLA dot of two e4m3 operands in cuBLASLt's TN
    layout (no scales: the library's ceiling), the per-tensor `fp8_matmul` on it (impl xla_fp8: quantization and
    scales included), the block-scaled Pallas kernel with the activation quantization and without (kernel only),
    and the Mosaic kernel (kernel only, jax >= 0.11, M >= 128) with each of MOSAIC_TILES whose row multiple divides
    M (a pair of row tiles with cluster=2).
  * sweep (--sweep): tile options (block_m, block_n, num_warps, num_stages) of the block kernel at those shapes;
    grouped_sweep (--sweep too): the grouped kernel's, at 128 experts (the plain path) and 256 (byte pairs).
  * decode (--only decode): DeepSeek-V3.2's dense linears at 1 and 32 rows, the block kernel with its K split over
    1..16 programs (`split_k`) against bf16 `jnp.dot` and the FP8 weight-read floor.
  * cublaslt (--only cublaslt): at 16..4096 rows `fp8_matmul` on cuBLASLt's own block-scaled GEMM
    (`fp8_matmul_cublaslt`), the Mosaic and the Triton kernel (quantization included, as `auto` runs them) and
    cuBLASLt's GEMM alone, against bf16. The check section checks it (CUBLASLT_CHECKS: float32 and bf16 out, in and
    out of the CUDA graph) where it runs (not in interpret mode).
  * grouped: DeepSeek's routed experts, E = 256, hidden 7168 <-> moe_intermediate 2048, top-8 of uniformly random
    routing, 4096 and 256 tokens (x8 rows; `--tokens` picks others, e.g. decode's 1,8,32, with the routed experts'
    weight-read floor): the FP8 grouped kernel (with and without quantization) against our bf16
    `grouped_matmul` on the same shapes.
FLOP/s count 2·M·N·K; speed-ups are over the bf16 row of the same shape. Random operands are made on the device.
Times: `kernel_report.timeit` (back-to-back calls, median of rounds), short rounds so that the whole run, compilation
included, stays within 4 minutes on one H200; decode-sized rows (the decode section, the grouped section at 64
tokens or fewer) per call of one executable that runs the op over several weight copies or routings
(`in_one_graph`), since a call that small timed on its own measures the host's dispatch. The last line is the
headline.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsa_kernels import routed_sizes
from jaxmodels.benchmark_floors import COPY_BANDWIDTH  # the H200's device-to-device copy rate
from kernel_report import ROWS, copies_for, in_one_graph, open_log, say, section, timeit
from pallas_kernels._mosaic import mosaic_kernels_available
from pallas_kernels.fp8_matmul import (fp8_grouped_matmul, fp8_matmul, fp8_matmul_xla_fp8,
                                       quantize_activations, quantize_static, quantize_weight)
from pallas_kernels import fp8_matmul_cublaslt as fp8_cublaslt
from pallas_kernels.fp8_matmul_mosaic import fp8_block_grouped_matmul_mosaic, fp8_block_matmul_mosaic, row_multiple
from pallas_kernels.fp8_matmul_pallas import (default_tiles, fp8_block_grouped_matmul, fp8_block_matmul,
                                              needs_byte_pairs, suggested_split_k)
from pallas_kernels.grouped_matmul import default_block_m, grouped_matmul_pallas

BLOCK = (128, 128)
CHECK_TOLERANCE = 1e-3  # max |error| / max |ref|, see the module docstring
TN = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: x[M, K] · w[N, K]


@dataclasses.dataclass(frozen=True)
class Shapes:
    dense_rows: tuple[int, ...]
    K: int
    N: int
    experts: int
    hidden: int
    intermediate: int
    topk: int
    tokens: tuple[int, ...]
    checks: tuple  # dense (M, K, N, options) checked against the reference
    grouped_check: tuple  # (E, M, K, N)
    sweep: dict  # rows -> list of tile options
    decode_linears: tuple  # (name, K, N) of the dense linears a decode step runs
    decode_rows: tuple[int, ...]


def tile_options(*rows):
    return [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s) for bm, bn, w, s in rows]


# 12 + 6 + 6 options: compilation dominates, and the whole script must fit a few minutes of device time.
SWEEP = {
    4096: tile_options((128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 4, 4), (128, 128, 8, 5), (128, 256, 8, 3),
                       (128, 256, 8, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4), (256, 128, 8, 3),
                       (64, 128, 4, 6), (128, 128, 4, 3)),
    128: tile_options((128, 128, 8, 4), (64, 128, 4, 4), (64, 64, 4, 4), (32, 64, 4, 4), (32, 128, 4, 4),
                      (128, 64, 4, 4)),
    16: tile_options((16, 64, 4, 4), (16, 128, 4, 4), (16, 32, 4, 4), (16, 64, 4, 6), (16, 64, 2, 4),
                     (16, 128, 8, 3)),
}
FULL = Shapes(dense_rows=(4096, 128, 16), K=7168, N=18432, experts=256, hidden=7168, intermediate=2048, topk=8,
              tokens=(4096, 256),
              checks=((4096, 7168, 18432, {}), (1000, 7168, 576, {}), (300, 1536, 2048, dict(block_n=256)),
                      (16, 512, 32768, {}), (64, 200, 256, {}),  # a partial K block (e4m3 zero fill)
                      (1, 7168, 576, dict(split_k=8)), (32, 16384, 7168, dict(split_k=5))),  # K split over programs
              grouped_check=(16, 2000, 7168, 2048), sweep=SWEEP,
              # DeepSeek-V3.2: q_a, kv_a (latent + rope key), q_b (128 heads x 192), o_proj, the indexer's wq_b
              # (64 heads x 128) and the dense MLP's down projection.
              decode_linears=(("q_a", 7168, 1536), ("kv_a", 7168, 576), ("q_b", 1536, 24576),
                              ("o_proj", 16384, 7168), ("indexer wq_b", 1536, 8192), ("mlp down", 18432, 7168)),
              decode_rows=(1, 32))
# CPU smoke shapes (--interpret): every section runs, nothing it times means anything.
TINY = Shapes(dense_rows=(40, 16), K=320, N=384, experts=4, hidden=256, intermediate=128, topk=2, tokens=(24, 4),
              checks=((40, 320, 384, dict(block_m=16)), (20, 256, 576, dict(block_m=16, block_n=256)),
                      (3, 640, 192, dict(split_k=3))),
              grouped_check=(4, 40, 256, 192),
              sweep={40: tile_options((16, 64, 4, 2)), 16: tile_options((16, 128, 4, 2))},
              decode_linears=(("tiny", 640, 192),), decode_rows=(1,))
SHAPES = FULL
INTERPRET = False
FAILED_CHECKS: list[str] = []


def random_activations(key, rows, cols):
    return jax.random.normal(key, (rows, cols), jnp.float32).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("shape",))
def random_fp8_weight(key, shape):
    """e4m3 weights [..., N, K] with their block scales, quantized on the device from normals of std K^-1/2."""
    return quantize_weight(jax.random.normal(key, shape, jnp.float32) * shape[-1] ** -0.5, BLOCK)


# The Mosaic GPU kernel (jax >= 0.11, on the GPU only), the tiles it is timed with and the options it is checked
# with. On the H200 (2026-12-01) 3 steps in flight and clusters of two (w's tiles multicast to pairs of CTAs) were
# within 2% of the default.
MOSAIC = mosaic_kernels_available()
MOSAIC_TILES = [dict(tile_m=64, steps_in_flight=4), dict(tile_m=64, steps_in_flight=4, cluster=2)]
MOSAIC_CHECKS = [{}, dict(cluster=2)]
CUBLASLT_ROWS = (4096, 2048, 1024, 512, 256, 128, 16)  # the cublaslt section's dense rows
CUBLASLT_CHECKS = [dict(out_dtype=jnp.float32), dict(out_dtype=jnp.float32, command_buffer=False),
                   dict(out_dtype=jnp.bfloat16)]

# The e4m3 dot's algorithm: XLA's default, float32 accumulation (what fp8_matmul_xla_fp8 asks for on the GPU), and
# cuBLASLt's fast (unpromoted) accumulation.
DOT_ALGORITHMS = [None, lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32, lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM]


def time_row(label, f, *args, flops, baseline=None, target_s=0.15, calls=1):
    """Times f(*args), prints one row (ms, TFLOP/s, speed-up over `baseline`'s seconds) and returns the seconds;
    per call of the op when f runs it `calls` times (`in_one_graph`)."""
    t = timeit(f, *args, target_s=target_s) / calls
    speedup = f"  x{baseline / t:5.2f} of bf16" if baseline else ""
    say(f"  {label:<58} {t * 1e3:9.3f} ms {flops / t / 1e12:8.1f} TFLOP/s{speedup}")
    return t


def time_tiles(variants, kernel_with, args, *, flops, baseline=None, calls=1):
    """Times `kernel_with(options)(*args)` for each tile options dict, one row each; (seconds, options) of the
    fastest, or None when none compiled."""
    timings = []
    for options in variants:
        try:
            timings.append((time_row(f"{options}", kernel_with(options), *args, flops=flops, baseline=baseline,
                                     target_s=0.08, calls=calls), options))
        except Exception as e:  # noqa: BLE001 (a tile Triton cannot compile: report it, keep sweeping)
            say(f"  {options}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return min(timings, key=lambda pair: pair[0]) if timings else None


def relative_max_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def report_check(label, error, extra_ok=True, tolerance=CHECK_TOLERANCE):
    ok = error < tolerance and extra_ok
    say(f"  check {label}: max err / max |ref| {error:.2e} {'ok' if ok else 'FAILED'}")
    if not ok:
        FAILED_CHECKS.append(label)


# ------------------------------------------------------------------------------------------------- checks

@section
def check():
    for M, K, N, options in SHAPES.checks:
        keys = jax.random.split(jax.random.key(M + N), 2)
        x = random_activations(keys[0], M, K).astype(jnp.float32)
        w8, w_scale = random_fp8_weight(keys[1], (N, K))
        got = jax.jit(lambda a, b, c: fp8_matmul(a, b, c, block=BLOCK, impl="pallas", interpret=INTERPRET,
                                                 **options))(x, w8, w_scale)
        want = jax.jit(lambda a, b, c: fp8_matmul(a, b, c, block=BLOCK, impl="xla"))(x, w8, w_scale)
        report_check(f"block M={M} K={K} N={N} {options}", relative_max_error(got, want))
        if MOSAIC and not K % 128 and not N % 128:
            for o in MOSAIC_CHECKS:  # fp8_matmul pads the rows to the kernel's (a pair of row tiles with clusters)
                check_kernel(f"block Mosaic kernel M={M} K={K} N={N} {o}", want, lambda: jax.jit(
                    lambda a, b, c: fp8_matmul(a, b, c, block=BLOCK, impl="mosaic", **o))(x, w8, w_scale))
        if not INTERPRET and not fp8_cublaslt.cublaslt_problem(N, K, BLOCK):
            for o in CUBLASLT_CHECKS:  # float32 and bf16 out (its rounding: ~4e-3), in and out of the CUDA graph
                gemm = functools.partial(fp8_cublaslt.fp8_block_matmul_cublaslt, **o)
                check_kernel(f"block cuBLASLt M={M} K={K} N={N} {o}", want,
                             lambda: jax.jit(lambda a, b, c: gemm(*quantize_activations(a, 128), b, c))(x, w8, w_scale),
                             tolerance=CHECK_TOLERANCE if o["out_dtype"] == jnp.float32 else 1e-2)
        scale, input_scale = jnp.float32(0.01), jnp.float32(4 / 448)
        got = jax.jit(lambda a, b: fp8_matmul(a, b, scale, block=None, input_scale=input_scale,
                                              impl="xla_fp8"))(x, w8)
        want = jax.jit(lambda a, b: fp8_matmul(a, b, scale, block=None, input_scale=input_scale, impl="xla"))(x, w8)
        report_check(f"per-tensor xla_fp8 M={M} K={K} N={N}", relative_max_error(got, want))
        x8 = quantize_static(x, input_scale)
        for algorithm in DOT_ALGORITHMS[1:] if M > 1 else ():  # the e4m3 dot's accumulation, for the record (not a
            # check; one row is a vector-matrix dot, which XLA compiles with no FP8 algorithm: fp8_matmul pads it)
            dot = jax.jit(lambda a, b, p=algorithm: lax.dot_general(a, b, TN, precision=p,
                                                                    preferred_element_type=jnp.float32))
            say(f"    e4m3 dot {getattr(algorithm, 'name', 'default')}: max err / max |ref| "
                f"{relative_max_error(dot(x8, w8) * (input_scale * scale), want):.2e}")
    E, M, K, N = SHAPES.grouped_check
    keys = jax.random.split(jax.random.key(E), 3)
    x = random_activations(keys[0], M, K).astype(jnp.float32)
    w8, w_scale = random_fp8_weight(keys[1], (E, N, K))
    sizes = jax.random.randint(keys[2], (E,), 0, 2 * M // (E + 2)).at[1].set(0).astype(jnp.int32)  # a tail too
    total = int(sizes.sum())
    per_tensor = dict(block=None, input_scale=jnp.linspace(2, 6, E) / 448)
    for name, w_scales, options in [("block", w_scale, dict(block=BLOCK)),
                                    ("per-tensor", w_scale[:, 0, 0], per_tensor)]:
        got = jax.jit(lambda a, b, c, d: fp8_grouped_matmul(a, b, c, d, impl="pallas", interpret=INTERPRET,
                                                            **options))(x, w8, w_scales, sizes)
        want = jax.jit(lambda a, b, c, d: fp8_grouped_matmul(a, b, c, d, impl="xla", **options))(x, w8, w_scales,
                                                                                                 sizes)
        tail_zero = not np.asarray(got[total:]).any()
        report_check(f"grouped {name} E={E} M={M} ({total} routed) K={K} N={N}, tail zero {tail_zero}",
                     relative_max_error(got[:total], want[:total]), tail_zero)
        if MOSAIC and name == "block":
            check_kernel(f"grouped block Mosaic kernel E={E} M={M} ({total} routed)", want, lambda: jax.jit(
                lambda a, b, c, d: fp8_grouped_matmul(a, b, c, d, impl="mosaic", **options))(x, w8, w_scales, sizes),
                rows=total)
    check_past_32_bit_offsets()


def check_kernel(label, want, compute, rows=None, tolerance=CHECK_TOLERANCE):
    """A check of a kernel that may fail to compile or to run (Mosaic, cuBLASLt): a failure is reported as a failed
    check, and the section goes on with the checks after it."""
    try:
        got = compute()
    except Exception as e:  # noqa: BLE001
        say(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        report_check(label, float("inf"))
        return
    if rows is None:
        report_check(label, relative_max_error(got, want), tolerance=tolerance)
    else:  # grouped: rows past the routed ones must stay zero
        report_check(label, relative_max_error(got[:rows], want[:rows]), not np.asarray(got[rows:]).any())


def check_past_32_bit_offsets():
    """One device's DeepSeek-V3 down projection, 256 x 7168 x 2048 e4m3 (past 2^31 elements: the kernel takes it as
    channel pairs), rows routed to the first, a middle and the last expert; the reference per expert."""
    E, N, K = 256, SHAPES.hidden, SHAPES.intermediate
    w8, w_scale = random_fp8_weight(jax.random.key(40), (E, N, K))
    sizes = jnp.zeros((E,), jnp.int32).at[jnp.array([0, 100, E - 1])].set(jnp.array([40, 17, 71]))
    x = random_activations(jax.random.key(41), 128, K).astype(jnp.float32)
    got = jax.jit(lambda a, b, c, d: fp8_grouped_matmul(a, b, c, d, block=BLOCK, impl="pallas",
                                                       interpret=INTERPRET))(x, w8, w_scale, sizes)
    parts, start = [], 0
    for g, n in [(0, 40), (100, 17), (E - 1, 71)]:
        parts.append(fp8_matmul(x[start:start + n], w8[g], w_scale[g], block=BLOCK, impl="xla"))
        start += n
    report_check(f"grouped block E={E} K={K} N={N} (w8 past 2^31 elements)",
                 relative_max_error(got, jnp.concatenate(parts)))


# ------------------------------------------------------------------------------------------------- dense

def dense_operands(M):
    K, N = SHAPES.K, SHAPES.N
    keys = jax.random.split(jax.random.key(M), 2)
    x = random_activations(keys[0], M, K)
    w8, w_scale = random_fp8_weight(keys[1], (N, K))
    return x, w8, w_scale


def dense_cases(rows):
    """(M, FLOPs, x, w8, w_scale, bf16 `jnp.dot` seconds) for each M of `rows`, the bf16 row printed."""
    K, N = SHAPES.K, SHAPES.N
    for M in rows:
        flops = 2 * M * K * N
        say(f"\n  M={M} K={K} N={N}")
        x, w8, w_scale = dense_operands(M)
        w_kn = jax.random.normal(jax.random.key(1), (K, N), jnp.bfloat16)
        bf16 = time_row(f"bf16 jnp.dot x @ w[K,N] M={M}", jax.jit(jnp.dot), x, w_kn, flops=flops)
        del w_kn
        yield M, flops, x, w8, w_scale, bf16


@section
def dense():
    K, N = SHAPES.K, SHAPES.N
    for M, flops, x, w8, w_scale, bf16 in dense_cases(SHAPES.dense_rows):
        w_nk = jax.random.normal(jax.random.key(1), (N, K), jnp.bfloat16)
        time_row(f"bf16 dot_general w[N,K] M={M}", jax.jit(lambda a, b: lax.dot_general(a, b, TN)), x, w_nk,
                 flops=flops, baseline=bf16)
        del w_nk
        x8 = jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn)
        for algorithm in DOT_ALGORITHMS:
            time_row(f"XLA e4m3 dot_general TN -> float32 (cuBLASLt) {getattr(algorithm, 'name', 'default')} M={M}",
                     jax.jit(lambda a, b, p=algorithm: lax.dot_general(a, b, TN, precision=p,
                                                                       preferred_element_type=jnp.float32)),
                     x8, w8, flops=flops, baseline=bf16)
        scale, input_scale = jnp.float32(0.01), jnp.float32(4 / 448)
        time_row(f"fp8_matmul per-tensor xla_fp8 (quantize + scale) M={M}",
                 jax.jit(lambda a, b: fp8_matmul_xla_fp8(a, b, scale, input_scale=input_scale)), x, w8,
                 flops=flops, baseline=bf16)
        time_row(f"fp8_matmul block pallas (quantize + kernel) M={M} {default_tiles(M)}",
                 jax.jit(lambda a, b, c: fp8_matmul(a, b, c, block=BLOCK, impl="pallas", interpret=INTERPRET)),
                 x, w8, w_scale, flops=flops, baseline=bf16)
        x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
        kernel = jax.jit(lambda a, s, b, c: fp8_block_matmul(a, s, b, c, block=BLOCK, out_dtype=jnp.bfloat16,
                                                             interpret=INTERPRET))
        t = time_row(f"fp8_block_matmul kernel only M={M}", kernel, x8, x_scale, w8, w_scale, flops=flops,
                     baseline=bf16)
        ROWS.append(f"dense M={M} K={K} N={N}: block FP8 kernel {flops / t / 1e12:.0f} TFLOP/s = "
                    f"x{bf16 / t:.2f} bf16 jnp.dot ({flops / bf16 / 1e12:.0f} TFLOP/s)")
        if MOSAIC and M >= 128:
            say(f"  fp8_block_matmul_mosaic kernel only M={M}:")
            tiles = [o for o in MOSAIC_TILES if not M % row_multiple(o["tile_m"], o.get("cluster", 1))]
            fastest = time_tiles(tiles, lambda o: jax.jit(lambda a, s, b, c: fp8_block_matmul_mosaic(
                a, s, b, c, **o)), (x8, x_scale, w8, w_scale), flops=flops, baseline=bf16)
            if fastest:
                t, best = fastest
                ROWS.append(f"dense M={M}: Mosaic FP8 kernel, best {best} {flops / t / 1e12:.0f} TFLOP/s = "
                            f"x{bf16 / t:.2f} bf16")


@section
def sweep():
    K, N = SHAPES.K, SHAPES.N
    for M, variants in SHAPES.sweep.items():
        flops = 2 * M * K * N
        x, w8, w_scale = dense_operands(M)
        x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
        say(f"\n  sweep M={M} K={K} N={N} (kernel only; default {default_tiles(M)})")
        fastest = time_tiles(variants, lambda o: jax.jit(lambda a, s, b, c: fp8_block_matmul(
            a, s, b, c, block=BLOCK, out_dtype=jnp.bfloat16, interpret=INTERPRET, **o)),
            (x8, x_scale, w8, w_scale), flops=flops)
        if fastest:
            t, best = fastest
            ROWS.append(f"sweep M={M}: best {best} {t * 1e3:.3f} ms = {flops / t / 1e12:.0f} TFLOP/s")


# ------------------------------------------------------------------------------------------------- decode
SPLITS = (1, 2, 4, 8, 16)  # split_k options of the block kernel at decode's few rows


def weight_copies(nbytes: int) -> int:
    """`copies_for` on the GPU; one in interpret mode, where nothing timed means anything."""
    return 1 if INTERPRET else copies_for(nbytes)


@section
def decode():
    """The dense FP8 linears of a DeepSeek-V3.2 decode step at a few rows (where `auto` runs the Triton block
    kernel): K split over 1..16 programs per output tile against bf16 `jnp.dot` and the FP8 weight-read floor. At
    one row the kernel reads each weight once, so the floor is N x K bytes (plus scales) at the HBM rate. Each row
    is the time per call over `weight_copies` weight copies in one executable (`in_one_graph`)."""
    splits = SPLITS if not INTERPRET else (1, 2)
    for name, K, N in SHAPES.decode_linears:
        copies = weight_copies(N * K)
        weights = [random_fp8_weight(jax.random.key(K + N + i), (N, K)) for i in range(copies)]
        bf16_weights = [(jax.random.normal(jax.random.key(N + i), (K, N), jnp.bfloat16),) for i in range(copies)]
        floor = (N * K + weights[0][1].size * 4) / COPY_BANDWIDTH
        for M in SHAPES.decode_rows:
            flops = 2 * M * K * N
            x = random_activations(jax.random.key(M), M, K)
            say(f"\n  {name} M={M} K={K} N={N}: FP8 weight-read floor {floor * 1e3:.4f} ms "
                f"(default tiles {default_tiles(M)}; {copies} weight copies in one graph)")
            bf16 = time_row("bf16 jnp.dot x @ w[K,N]", in_one_graph(jnp.dot), (x,), bf16_weights, flops=flops,
                            calls=copies)
            x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
            suggested = suggested_split_k(M, N, K, BLOCK)
            say(f"  suggested_split_k: {suggested}")
            fastest = time_tiles([dict(split_k=k) for k in sorted({*splits, suggested})],
                                 lambda o: in_one_graph(lambda a, s, b, c: fp8_block_matmul(
                                     a, s, b, c, block=BLOCK, out_dtype=jnp.bfloat16, interpret=INTERPRET, **o)),
                                 ((x8, x_scale), weights), flops=flops, baseline=bf16, calls=copies)
            if fastest:
                t, best = fastest
                ROWS.append(f"decode {name} M={M} K={K} N={N}: best {best} {t * 1e3:.4f} ms = x{bf16 / t:.2f} bf16, "
                            f"{floor / t:.0%} of the FP8 weight-read floor")
        del weights, bf16_weights


# ------------------------------------------------------------------------------------------------- grouped

@section
def grouped():
    E, topk = SHAPES.experts, SHAPES.topk
    for K, N, name in [(SHAPES.hidden, SHAPES.intermediate, "up/gate"), (SHAPES.intermediate, SHAPES.hidden, "down")]:
        w8, w_scale = random_fp8_weight(jax.random.key(K), (E, N, K))
        w_bf16 = jax.random.normal(jax.random.key(N), (E, K, N), jnp.bfloat16)
        for tokens in SHAPES.tokens:
            M = tokens * topk
            flops = 2 * M * K * N
            x = random_activations(jax.random.key(tokens), M, K)
            # decode's few tokens: several routings in one executable (`in_one_graph`), each its own experts
            routings = [(routed_sizes(jax.random.key(tokens + 1 + i), tokens, E, topk),)
                        for i in range(16 if tokens <= 64 and not INTERPRET else 1)]
            label = f"{name} E={E} K={K} N={N} tokens={tokens} (M={M})"
            routed = np.mean([np.count_nonzero(np.asarray(sizes)) for sizes, in routings])
            say(f"\n  {label}: {routed:.1f} experts routed, their FP8 weight-read floor "
                f"{routed * N * K / COPY_BANDWIDTH * 1e3:.4f} ms ({len(routings)} routings in one graph)")
            timed = functools.partial(time_row, flops=flops, calls=len(routings))
            bf16 = timed(f"bf16 grouped_matmul block_m={default_block_m(M, E)}",
                         in_one_graph(lambda a, b, c: grouped_matmul_pallas(a, b, c, interpret=INTERPRET)),
                         (x, w_bf16), routings)
            timed(f"fp8_grouped_matmul block pallas (quantize + kernel) {default_tiles(M, E)}",
                  in_one_graph(lambda a, b, c, d: fp8_grouped_matmul(a, b, c, d, block=BLOCK, impl="pallas",
                                                                     interpret=INTERPRET)),
                  (x, w8, w_scale), routings, baseline=bf16)
            x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
            t = timed("fp8_block_grouped_matmul kernel only",
                      in_one_graph(lambda a, s, b, c, d: fp8_block_grouped_matmul(
                          a, s, b, c, d, block=BLOCK, out_dtype=jnp.bfloat16, interpret=INTERPRET)),
                      (x8, x_scale, w8, w_scale), routings, baseline=bf16)
            ROWS.append(f"grouped {label}: FP8 kernel {flops / t / 1e12:.0f} TFLOP/s = x{bf16 / t:.2f} bf16 "
                        f"grouped_matmul ({flops / bf16 / 1e12:.0f} TFLOP/s)")
            if MOSAIC:
                try:
                    t = timed("fp8_block_grouped_matmul_mosaic kernel only (+ row gather)",
                              in_one_graph(fp8_block_grouped_matmul_mosaic), (x8, x_scale, w8, w_scale), routings,
                              baseline=bf16)
                    ROWS.append(f"grouped {label}: Mosaic FP8 kernel x{bf16 / t:.2f} bf16 grouped_matmul")
                except Exception as e:  # noqa: BLE001 (report it, keep going)
                    say(f"  mosaic grouped: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        del w8, w_scale, w_bf16


# Tiles of the grouped kernel, kernel only, at the up/gate shape: 128 experts (1.9 G e4m3 elements: the plain path,
# as one device of a model sharded two ways or more holds) and 256 (byte pairs), decode (256 tokens) and prefill.
GROUPED_SWEEP = {
    256: tile_options((16, 64, 4, 4), (16, 128, 4, 4), (16, 32, 4, 4), (16, 64, 4, 6), (32, 64, 4, 4),
                      (16, 128, 8, 3)),
    4096: tile_options((128, 128, 8, 4), (128, 64, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3), (64, 64, 4, 4)),
}


@section
def grouped_sweep():
    K, N, topk = SHAPES.hidden, SHAPES.intermediate, SHAPES.topk
    for E in (SHAPES.experts // 2, SHAPES.experts):
        w8, w_scale = random_fp8_weight(jax.random.key(E), (E, N, K))
        w_bf16 = jax.random.normal(jax.random.key(N), (E, K, N), jnp.bfloat16)
        for tokens, variants in (GROUPED_SWEEP if not INTERPRET else {24: tile_options((16, 64, 4, 2))}).items():
            M = tokens * topk
            flops = 2 * M * K * N
            x = random_activations(jax.random.key(tokens), M, K)
            sizes = routed_sizes(jax.random.key(tokens + 1), tokens, E, topk)
            x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
            say(f"\n  grouped sweep E={E} K={K} N={N} tokens={tokens} (M={M}; byte pairs "
                f"{needs_byte_pairs(w8)}; default {default_tiles(M, E)})")
            bf16 = time_row(f"bf16 grouped_matmul block_m={default_block_m(M, E)}",
                            jax.jit(lambda a, b, c: grouped_matmul_pallas(a, b, c, interpret=INTERPRET)),
                            x, w_bf16, sizes, flops=flops)
            fastest = time_tiles(variants, lambda o: jax.jit(lambda a, s, b, c, d: fp8_block_grouped_matmul(
                a, s, b, c, d, block=BLOCK, out_dtype=jnp.bfloat16, interpret=INTERPRET, **o)),
                (x8, x_scale, w8, w_scale, sizes), flops=flops, baseline=bf16)
            if fastest:
                t, best = fastest
                ROWS.append(f"grouped sweep E={E} tokens={tokens}: best {best} {t * 1e3:.3f} ms = x{bf16 / t:.2f} "
                            f"bf16 grouped_matmul")
        del w8, w_scale, w_bf16


@section
def cublaslt():
    """cuBLASLt's own block scaling (`fp8_matmul_cublaslt`; its checks are the check section's) at 16..4096 rows."""
    # The rows where `fp8_matmul`'s CUBLASLT_MIN_ROWS and MOSAIC_MIN_ROWS draw their lines, each path as `auto` runs
    # it (quantization included), then cuBLASLt's GEMM alone (the target's row).
    for M, flops, x, w8, w_scale, bf16 in dense_cases(CUBLASLT_ROWS):
        for impl in ("cublaslt", "mosaic", "pallas") if MOSAIC else ("cublaslt", "pallas"):
            time_row(f"fp8_matmul impl={impl} (quantize + GEMM) M={M}",
                     jax.jit(lambda a, b, c, i=impl: fp8_matmul(a, b, c, block=BLOCK, impl=i)), x, w8, w_scale,
                     flops=flops, baseline=bf16)
        x8, x_scale = jax.jit(lambda a: quantize_activations(a, BLOCK[1]))(x)
        t = time_row(f"cuBLASLt block GEMM only M={M}", jax.jit(fp8_cublaslt.fp8_block_matmul_cublaslt),
                     x8, x_scale, w8, w_scale, flops=flops, baseline=bf16)
        ROWS.append(f"dense M={M}: cuBLASLt block FP8 {flops / t / 1e12:.0f} TFLOP/s = x{bf16 / t:.2f} bf16")


def main():
    global SHAPES, INTERPRET, MOSAIC
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="correctness of the compiled kernels first")
    ap.add_argument("--sweep", action="store_true", help="time tile options of the block kernel")
    ap.add_argument("--only", default="",
                    help="comma list of sections: check,dense,sweep,decode,cublaslt,grouped,grouped_sweep (decode and "
                         "cublaslt run only when named)")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: interpret mode, tiny shapes")
    ap.add_argument("--tokens", default=None,
                    help="comma list of token counts for the grouped section (default 4096,256; decode: 1,8,32)")
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    INTERPRET = args.interpret
    SHAPES = TINY if INTERPRET else FULL
    if args.tokens:
        SHAPES = dataclasses.replace(SHAPES, tokens=tuple(int(t) for t in args.tokens.split(",")))
    if INTERPRET:  # the CPU takes no algorithm for FP8 dots; the Mosaic kernel has its own interpreter tests
        del DOT_ALGORITHMS[1:]
        MOSAIC = False
    open_log(args.log)
    say(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f"{', tiny shapes in interpret mode' if INTERPRET else ''}")
    only = set(filter(None, args.only.split(",")))
    want = lambda s: (not only or s in only)  # noqa: E731
    if args.check and want("check"):
        check()
    if want("dense"):
        dense()
    if args.sweep and want("sweep"):
        sweep()
    if "decode" in only:
        decode()
    if "cublaslt" in only:
        cublaslt()
    if want("grouped"):
        grouped()
    if args.sweep and want("grouped_sweep"):
        grouped_sweep()
    say("\n=== summary")
    for r in ROWS:
        say(r)
    for label in FAILED_CHECKS:
        say(f"check FAILED: {label}")
    headline = next((r for r in ROWS if r.startswith(f"dense M={SHAPES.dense_rows[0]}")), None)
    say(f"headline: {headline or 'no dense timing'}")
    return 1 if FAILED_CHECKS or any(r.endswith(": FAILED") for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
