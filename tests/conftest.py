"""Shared pytest set-up: platform markers, and GPU memory taken as needed rather than preallocated.

Markers: `gpu` tests need a CUDA GPU and skip elsewhere; `cpu_only` tests check CPU-only behaviour (e.g. that a CPU
reports no device memory) and skip on a GPU machine; `slow` tests take tens of seconds each on the 2-core CPU (the
simulated-mesh subprocesses, the demo, prompts of thousands of tokens): they run first (`-m "not slow"` leaves them
out), so that under xdist the last tests to finish are short ones and both workers end together. The models set
their own matmul precision (float32 models run float32 dots everywhere, jaxmodels.precision), so no global precision
flag is set here: the GPU run of the parity tests checks exactly what users get.
"""

import gc
import glob
import os
import shutil
import tempfile
from importlib.metadata import version

_RUN_CACHE = None  # the compilation cache this process made for the run (CPU only; see below)

# Without this JAX takes 75% of the GPU at start: parallel test workers and the subprocesses some tests start (the
# CLI, the demo) would then run out of memory. No effect on CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The engine's compilation cache (on by default, under ~/.cache) stays off in tests, for them and the processes they
# start: a test's outcome must not depend on what an earlier run left on disk. test_compilation_cache.py turns it on
# where it is the subject; the GPU suite sets JAX's own cache (tools/gpu_check.sh), which still applies.
os.environ.setdefault("JAXMODELS_COMPILATION_CACHE_DIR", "off")
if not glob.glob("/dev/nvidia[0-9]*"):  # CPU only: tests compile faster; a GPU suite tests what users run
    # LLVM's level 0 instead of 3 in XLA's CPU backend: LLVM's optimization and instruction selection are most of a
    # CPU compile, and the suite is mostly compiling. Measured on the 2-core CI machine: a tiny model's extend step
    # compiles in 1.4 s instead of 2.7 s (2.2 s at level 1), and the whole suite takes 953 CPU-s instead of 1,540 at
    # level 1. The arithmetic stays IEEE float32 (no fast math); one difference: the code XLA emits at level 0
    # contracts no multiply-add into an FMA while the Eigen kernels it calls for dots do, so two programs differing
    # only in batch size can differ by an ulp. The tests asserting bit-identical rows across programs compile their
    # calls at level 1 (tests/bitwise.py).
    # And XLA's older loop emitters for CPU fusions instead of its MLIR fusion emitters, which build an MLIR context
    # and pipeline per fusion: a tiny engine's programs compile in ~25% less time, an eager op in ~35% less. The XLA of
    # jaxlib 0.11 no longer has the flag, and stops at start on a flag it does not know.
    older_emitters = tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11)
    for flag, value in (("--xla_backend_optimization_level", "0"),) + (
            (("--xla_cpu_use_fusion_emitters", "false"),) if older_emitters else ()):
        if flag not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), f"{flag}={value}"]))
    # One JAX compilation cache per test run, new each time (so no outcome depends on an earlier run), shared by
    # the xdist workers (they inherit the controller's environment): tests that build the same engine load each
    # other's step programs. Programs that compile in under 0.2 s are not stored, so that a test's own tiny jit
    # (the compilation counters' self-check) still compiles.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE = tempfile.mkdtemp(prefix="jaxmodels-test-xla-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from jaxmodels.precision import matmul_precision_for, precision_scope  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.fixture
def float32_matmuls():
    """Layers called on their own, outside a model, at a float32 model's precision (a model's forward and the
    engine's steps set it themselves; a bare layer call gets XLA's default, TF32 on the GPU)."""
    with precision_scope(matmul_precision_for(jnp.float32)):
        yield


@pytest.fixture
def cuda_lowering(monkeypatch):
    """`lower(jitted, *args) -> StableHLO text` of the program as a GPU would compile it, on any machine.

    Triton custom calls carry no serialization guarantee, hence the disabled check. From jax 0.11 on, lowering a
    Pallas Triton kernel asks the device for its compute capability; without a GPU the answer is an H200's.
    """
    try:
        from jax._src.pallas.triton import gpu_info
        gpu_info.get_gpu_info()
    except ImportError:  # jax 0.10 asks for nothing
        pass
    except ValueError:  # no GPU on this machine
        monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *args, **kwargs: type("H200", (), {
            "compute_capability": 90})())

    def lower(jitted, *args) -> str:
        exported = jax.export.export(jitted, platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        return exported.mlir_module()

    return lower


def pytest_unconfigure(config):
    """The run's compilation cache goes with the run (removed by the process that made it: the controller)."""
    if _RUN_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of seconds on the 2-core CPU; runs first (see above)")
    # Python's cycle collector: tracing and lowering allocate millions of short-lived objects, and at the default
    # thresholds each worker spent ~5 s per minute in collections that walk every module imported so far. Those are
    # frozen out of its view and collections come less often: on 2 cores, test_llm + the Nemotron-H parity + the
    # indexer kernel tests took 128-132 CPU-s instead of 137-143.
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 50, 100)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    # After the last test pytest's unraisable-exception cleanup runs five full collections, each 0.4-0.9 s in a
    # worker that has traced and compiled for minutes; with the rest of its teardown an xdist worker then outlived
    # the 5 s that execnet gives it once the run is over, and was sent SIGINT ("KeyboardInterrupt" ignored in jax's
    # gc callback, printed at the end of the CI log). One collection here reports any late unraisable exception as
    # before; the objects left are frozen, so that the cleanup's collections walk none of them.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    has_gpu = _has_gpu()
    skip = pytest.mark.skip(reason="checks CPU-only behaviour" if has_gpu else "needs a CUDA GPU")
    marker = "cpu_only" if has_gpu else "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
    # Slow tests first, in their order (a stable sort). Collected last (tests/sharding), they started when little
    # else was left to run beside them, and a worker could wait minutes for the other. None takes a module-scoped
    # fixture, which moving it away from its module's other tests would build twice.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
