"""Compile a kernel for an H200 on a machine without a GPU, and report what ptxas makes of it: registers and spills
per kernel, and with --sass where the spills are.

XLA compiles for a GPU it is only told about (a topology from a target description, `H200_TARGET`): Triton's and
Mosaic GPU's kernels go through the same lowering to PTX as on the H200, and this tool runs ptxas on each kernel's
PTX for sm_90a. It answers "does it compile, and does it spill" in a minute on a CPU machine; speed still needs the
GPU. The lowering is the local jax's (0.10 here, 0.11 on the H200), so a kernel that compiles here can still meet an
API difference there.

    bash tools/aot_venv.sh                       # once: .venv-aot, this jax with its CUDA plugin
    .venv-aot/bin/python tools/aot_h200.py sparse_mla_mosaic --batch 128
    .venv-aot/bin/python tools/aot_h200.py sparse_mla_mosaic --set OWNER_COLUMNS=192 --set OWNER_REGISTERS=240
    .venv-aot/bin/python tools/aot_h200.py sparse_mla_triton --batch 128 --block-h 32
    .venv-aot/bin/python tools/aot_h200.py fp8_mosaic --sass /tmp/sass
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# What XLA needs to know of the H200 to compile for it (its StreamExecutor device description).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[dict]:
    """ptxas -v's report -> one dict per entry function: kernel, registers, stack, spill_stores, spill_loads (bytes).
    The registers are those the kernel launches with; a kernel that raises its warpgroups' count (setmaxnreg) uses
    more in places, and spills there show as spills."""
    reports, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = dict(kernel=m.group(1), registers=None, stack=0, spill_stores=0, spill_loads=0)
            reports.append(current)
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
    return reports


def _tool(name: str) -> str:
    """A CUDA tool: $PTXAS / $NVDISASM, then PATH, then the nvidia-* wheels in this Python's site-packages."""
    found = os.environ.get(name.upper()) or shutil.which(name)
    if not found:
        import site

        for base in site.getsitepackages():
            candidates = sorted(Path(base).glob(f"nvidia/cu*/bin/{name}"))
            if candidates:
                return str(candidates[-1])
        raise SystemExit(f"{name} not found: put it on PATH or set ${name.upper()}")
    return found


def ptxas_reports(dump: Path, sass: Path | None = None) -> list[dict]:
    """Run ptxas for sm_90a on every PTX file under `dump`; with `sass`, disassemble each into it too."""
    reports = []
    for ptx in sorted(dump.rglob("*.ptx")):
        if ".entry" not in ptx.read_text():  # XLA writes a PTX file for modules without kernels too
            continue
        cubin = ptx.with_suffix(".cubin")
        done = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                              capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"ptxas failed on {ptx.name}:\n{done.stderr}")
        for report in parse_ptxas(done.stdout + done.stderr):
            reports.append(dict(report, ptx=ptx.name))
        if sass is not None:
            sass.mkdir(parents=True, exist_ok=True)
            listing = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                                     check=True).stdout
            (sass / f"{ptx.stem}.sass").write_text(listing)
    return reports


def compile_for_h200(fn, *shapes):
    """jax.jit(fn) compiled for one H200 from abstract arguments (jax.ShapeDtypeStruct)."""
    import jax
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("device",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated) for s in shapes]
    return jax.jit(fn).lower(*args).compile()


def _recipes(args):
    """name -> (function, abstract arguments): the kernels at the shapes the benchmarks time."""
    import jax
    import jax.numpy as jnp

    S = jax.ShapeDtypeStruct
    B, H, k = args.batch, 128, 2048
    mla = (S((B, H, 576), jnp.bfloat16), S((1 << 18, 576), jnp.bfloat16), S((B, k), jnp.int32))

    def sparse_mla_mosaic():
        from pallas_kernels.sparse_mla_mosaic import sparse_mla_decode_mosaic

        return lambda q, c, i: sparse_mla_decode_mosaic(q, c, i, scale=0.04, num_splits=args.splits), mla

    def sparse_mla_triton():
        from pallas_kernels.sparse_mla_attention import sparse_mla_attention_pallas

        options = {k: v for k, v in dict(block_h=args.block_h, num_warps=args.num_warps,
                                          num_splits=args.splits).items() if v is not None}
        return lambda q, c, i: sparse_mla_attention_pallas(q, c, i, scale=0.04, **options), mla

    def fp8_mosaic():
        from pallas_kernels.fp8_matmul_mosaic import fp8_block_matmul_mosaic

        M, K, N = 4096, 7168, 18432
        return (lambda a, s, b, t: fp8_block_matmul_mosaic(a, s, b, t),
                (S((M, K), jnp.float8_e4m3fn), S((M, K // 128), jnp.float32), S((N, K), jnp.float8_e4m3fn),
                 S((N // 128, K // 128), jnp.float32)))

    return dict(sparse_mla_mosaic=sparse_mla_mosaic, sparse_mla_triton=sparse_mla_triton, fp8_mosaic=fp8_mosaic)


KERNEL_MODULES = dict(sparse_mla_mosaic="pallas_kernels.sparse_mla_mosaic",
                      sparse_mla_triton="pallas_kernels.sparse_mla_attention",
                      fp8_mosaic="pallas_kernels.fp8_matmul_mosaic")


def set_constants(module_name: str, assignments: list[str]):
    """`--set NAME=VALUE`: the kernel's module constants to compile with (a variant's schedule or registers)."""
    import ast
    import importlib

    module = importlib.import_module(module_name)
    for assignment in assignments:
        name, _, text = assignment.partition("=")
        if not hasattr(module, name):
            raise SystemExit(f"{module_name} has no constant {name}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(module, name, value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=["sparse_mla_mosaic", "sparse_mla_triton", "fp8_mosaic"])
    parser.add_argument("--batch", type=int, default=128, help="decode batch (queries) of the sparse MLA kernels")
    parser.add_argument("--splits", type=int, default=None, help="sparse MLA: programs a list (default: the kernel's)")
    parser.add_argument("--block-h", type=int, default=None, help="sparse MLA Triton: heads a program")
    parser.add_argument("--num-warps", type=int, default=None, help="sparse MLA Triton: warps a program")
    parser.add_argument("--sass", type=Path, default=None, help="write each kernel's SASS here (needs nvdisasm)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="set a constant of the kernel's module first (a Python literal, else a string)")
    args = parser.parse_args(argv)

    dump = Path(tempfile.mkdtemp(prefix="aot_h200_"))
    (dump / "mosaic").mkdir()  # Mosaic GPU writes to stdout where its folder is missing
    # Read when the backends start and when Mosaic GPU compiles: set before jax is imported.
    os.environ.update(CUDA_VISIBLE_DEVICES="-1", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_TO=str(dump / "mosaic"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump / 'xla'}".strip()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    set_constants(KERNEL_MODULES[args.kernel], args.set)
    fn, shapes = _recipes(args)[args.kernel]()
    compile_for_h200(fn, *shapes)
    reports = ptxas_reports(dump, args.sass)
    print(f"{args.kernel} for the H200 (sm_90a), ptxas -v on {len(reports)} kernel(s); PTX under {dump}")
    print(f"{'kernel':<40} {'registers':>9} {'spill stores':>12} {'spill loads':>11} {'stack':>6}")
    for r in reports:
        print(f"{r['kernel'][:40]:<40} {r['registers']:>9} {r['spill_stores']:>12} {r['spill_loads']:>11} "
              f"{r['stack']:>6}")


if __name__ == "__main__":
    main()
