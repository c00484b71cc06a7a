"""Digests of the Mosaic GPU modules the FP8 kernels lower to, debug info left out: a refactor of
`pallas_kernels/fp8_matmul_mosaic.py` that prints the same digests leaves the code the GPU runs unchanged, checked
without a GPU (jax >= 0.11, which lowers Mosaic GPU for CUDA on any machine).

    PYTHONPATH=. python bench/lab/mosaic_digest.py            # one line per kernel variant: sha256 and size
    git stash; PYTHONPATH=. python bench/lab/mosaic_digest.py; git stash pop    # before a refactor
    PYTHONPATH=. python bench/lab/mosaic_digest.py            # after it: the same lines, the same GPU code

Shapes: DeepSeek-V3.2's dense up projection (4096 x 7168 x 18432) and the routed experts of a 4096-token prefill
(256 experts, 32768 rows, 7168 -> 2048). Each module is captured as Mosaic GPU's lowering hands it to serialization,
printed without locations (which carry source line numbers) and without its dump name (a counter of the kernels
lowered before it in the process).
"""

from __future__ import annotations

import hashlib
import re
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul_mosaic import fp8_block_grouped_matmul_mosaic, fp8_block_matmul_mosaic

DENSE_VARIANTS = [dict(), dict(cluster=2), dict(steps_in_flight=3)]
F8, F32 = jnp.float8_e4m3fn, jnp.float32


def capture_modules(lower) -> list[str]:
    """The text of each Mosaic GPU module that `lower()` produces, without debug info."""
    from jax.experimental.mosaic.gpu import core

    modules, serialize = [], core._run_serde_pass

    def capture(module, **options):
        text = module.operation.get_asm(enable_debug_info=False)
        modules.append(re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "", text))
        return serialize(module, **options)

    core._run_serde_pass = capture
    try:
        lower()
    finally:
        core._run_serde_pass = serialize
    return modules


def export_for_cuda(f, *shapes):
    S = jax.ShapeDtypeStruct
    jax.export.export(jax.jit(f), platforms=["cuda"])(*(S(shape, dtype) for shape, dtype in shapes))


def main() -> int:
    M, K, N = 4096, 7168, 18432
    dense = [((M, K), F8), ((M, K // 128), F32), ((N, K), F8), ((N // 128, K // 128), F32)]
    E, rows, N_e = 256, 32768, 2048
    grouped = [((rows, K), F8), ((rows, K // 128), F32), ((E, N_e, K), F8), ((E, N_e // 128, K // 128), F32),
               ((E,), jnp.int32)]
    cases = [(f"dense {options}", lambda o=options: export_for_cuda(
        lambda a, s, b, t: fp8_block_matmul_mosaic(a, s, b, t, num_programs=132, **o), *dense))
        for options in DENSE_VARIANTS]
    cases.append(("grouped {}", lambda: export_for_cuda(
        lambda a, s, b, t, n: fp8_block_grouped_matmul_mosaic(a, s, b, t, n, num_programs=132), *grouped)))
    print(f"jax {jax.__version__}")
    for label, lower in cases:
        for text in capture_modules(lower):
            print(f"{hashlib.sha256(text.encode()).hexdigest()[:16]}  {len(text):8d} chars  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
