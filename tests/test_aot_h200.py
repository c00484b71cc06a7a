"""tools/aot_h200.py's reading of ptxas: the report of a real ptxas run on a Mosaic GPU kernel (a spilling one), and
ptxas itself on a small hand-written kernel where the CUDA toolkit is on PATH (the GPU-less compile needs the CUDA
plugin's environment, tools/aot_venv.sh, and is not run here)."""

import importlib.util
import os
import shutil

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("aot_h200", os.path.join(ROOT, "tools", "aot_h200.py"))
aot_h200 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aot_h200)

# ptxas 13.0 -v on the first form of pallas_kernels/sparse_mla_mosaic.py (2026-12-04), then a second kernel.
REPORT = ("ptxas warning : Registers are spilled to local memory in function 'entry_mosaic_gpu_kernel', "
          "200 bytes spill stores, 200 bytes spill loads\n") + """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'entry_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for entry_mosaic_gpu_kernel
    184 bytes stack frame, 200 bytes spill stores, 200 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 184 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 318.691 ms
ptxas info    : Compiling entry function 'loop_broadcast_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_broadcast_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
"""

ADD_ONE = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry add_one(.param .u64 out)
{
    .reg .u64 %rd<3>;
    .reg .u32 %r<3>;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r1, %tid.x;
    add.u32 %r2, %r1, 1;
    st.global.u32 [%rd2], %r2;
    ret;
}
"""


def test_report_gives_each_kernels_registers_and_spills():
    assert aot_h200.parse_ptxas(REPORT) == [
        dict(kernel="entry_mosaic_gpu_kernel", registers=168, stack=184, spill_stores=200, spill_loads=200),
        dict(kernel="loop_broadcast_fusion", registers=10, stack=0, spill_stores=0, spill_loads=0)]


@pytest.mark.skipif(not (os.environ.get("PTXAS") or shutil.which("ptxas")), reason="no CUDA toolkit here")
def test_ptxas_runs_on_kernels_and_skips_modules_without_one(tmp_path):
    (tmp_path / "kernel.ptx").write_text(ADD_ONE)
    (tmp_path / "empty.ptx").write_text("//\n// no kernels in this module\n//\n")
    (report,) = aot_h200.ptxas_reports(tmp_path)
    assert report["kernel"] == "add_one" and report["ptx"] == "kernel.ptx"
    assert 1 <= report["registers"] <= 16 and report["spill_stores"] == report["spill_loads"] == 0
