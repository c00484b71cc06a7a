"""Decode-step fusions, on by default; `JAXMODELS_DECODE_FUSIONS=0` turns them off (to compare, or to rule them out):
  * MoE routing by counting for up to `moe.RANK_BY_COUNTING` (token, expert) pairs (`moe.expert_ranks`), and the
    experts' relu² inside the grouped matmul (its `epilogue`);
  * the residual add and the next RMSNorm in one kernel (`pallas_kernels.add_rms_norm`, `RMSNorm.add_and_norm`).
Each removes kernels from a decode step's CUDA graph (the one-sequence step is mostly small kernels, each with its
launch on the host and its gap on the device). The models compute the same values either way: the CPU tests compare
both paths, and `bash bench/lab/h200_runs.sh fusions_tests` runs the kernels' and the parity tests on the GPU with them
on. On the H200 (2026-12-02, `bash bench/lab/h200_runs.sh fusions_bench`, docs/BENCHMARKS.md) they take the Nano-30B
class's one-sequence decode step from 861 to 762 kernels (host 2.18 -> 1.59 ms a step) and its 256-sequence step
from 24.03 to 23.66 ms; the 4-layer DeepSeek's from 1.93 to 1.82 ms (B = 1) and 18.04 to 17.90 ms (B = 256).

Also on by default (`JAXMODELS_SHARED_EXPERT_IN_GMM=0` turns it off alone): an MoE layer's shared expert runs inside
its routed experts' grouped matmuls at decode (`MoE.shared_rides_with_experts`): its projections cut into experts of
the routed ones' size, every token one more row of each, so a few-token layer launches two grouped matmuls instead of
those plus the shared expert's two GEMMs and their one-row pads. On the H200 (2026-12-02, `bash bench/lab/h200_runs.sh
shared_gmm_tests shared_gmm_bench`, docs/BENCHMARKS.md): its kernel's and the parity tests pass on the GPU with it;
the Nano-30B class's decode step 3.10 -> 2.74 ms at one sequence (762 -> 647 kernels) and 6.36 -> 6.12 ms at 8; the
4-layer DeepSeek's 1.92 -> 1.88 ms at one sequence and 4.55 -> 4.69 ms at 8 (its device time 4.67 -> 4.70 ms: within
1%, the wall time's 3% not told from noise in that one run).
"""

import os

ENABLED = os.environ.get("JAXMODELS_DECODE_FUSIONS", "1") != "0"
SHARED_EXPERT_IN_GMM = os.environ.get("JAXMODELS_SHARED_EXPERT_IN_GMM", "1") != "0"
