"""Decode-step fusions written and tested on the CPU but not yet run on a GPU: off by default until they are.

`JAXMODELS_DECODE_FUSIONS=1` turns them on:
  * MoE routing by counting for up to `moe.RANK_BY_COUNTING` (token, expert) pairs (`moe.expert_ranks`), and the
    experts' relu² inside the grouped matmul (its `epilogue`);
  * the residual add and the next RMSNorm in one kernel (`pallas_kernels.add_rms_norm`, `RMSNorm.add_and_norm`).
Each removes kernels from a decode step's CUDA graph (the one-sequence step is mostly small kernels, each with its
launch on the host and its gap on the device). The models compute the same values either way: the CPU tests compare
both paths. Once `bash bench/h200_runs.sh quick_tests decode_profile` shows them correct and faster on the H200,
the default flips and this switch goes.
"""

import os

ENABLED = os.environ.get("JAXMODELS_DECODE_FUSIONS", "0") == "1"
