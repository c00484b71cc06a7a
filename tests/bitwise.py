"""For tests that assert two compiled programs give bit-identical rows (a request alone and in a padded batch).

On the CPU the suite compiles at LLVM level 0 (tests/conftest.py). There the code XLA emits contracts no multiply-add
into an FMA, while the Eigen kernels XLA calls for dots do, so two programs that differ only in batch size can
differ by an ulp in rows that both compute the same way (measured: 96 of 800 paged-attention outputs, 6e-8 apart).
That says nothing of the kernel under test, so such tests compile their calls at level 1, where emitted code
contracts FMAs as Eigen does (as XLA's default level 3 does), and keep their exact comparison.
"""

import jax


def jit_contracting_fmas(fn):
    """`fn` jitted so that, on the CPU, its code contracts multiply-adds into FMAs whatever the suite's LLVM level;
    on a GPU, plainly jitted."""
    on_cpu = jax.default_backend() == "cpu"
    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 1} if on_cpu else None)
