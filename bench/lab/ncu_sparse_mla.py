"""Sparse MLA decode at B = 128 launched once per tile variant, for Nsight Compute's counters (`bash
bench/lab/h200_runs.sh mla_ncu` runs this under `ncu --kernel-name regex:sparse_mla`).

The timings in bench/dsa_kernels.py say how far the kernel is from its floors (25.8% of the byte floor at B = 128);
the counters say which unit holds it there: tensor pipe busy, shared-memory wavefronts, L2 bytes, local-memory
(spill) traffic, and the warps' stall reasons. Every variant is compiled first, then each runs once in the order
printed, so the n-th profiled launch is the n-th variant. The problem is bench/dsa_kernels.py's: 128 heads,
latent 512 + 64, 2048 random rows of a 256k-row bf16 cache per query.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import pallas_kernels.sparse_mla_mosaic as mla
from pallas_kernels.sparse_mla_attention import sparse_mla_attention, sparse_mla_attention_pallas

VARIANTS = [
    dict(),  # the defaults at B = 128: 32 heads on 4 warps, 64-row gathers, 3 stages (mma.sync)
    dict(block_h=64, num_warps=8, block_k=64, num_stages=2),  # the 64-head tile on two warpgroups (wgmma)
    dict(block_k=32, num_stages=1, num_splits=1),  # the small decode tiles
]


def main():
    B, H, k, rows = 128, 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows // 64, 64, 576)).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.key(1), (B, H, 576)).astype(jnp.bfloat16)
    idx = jax.random.randint(jax.random.key(2), (B, k), 0, rows).astype(jnp.int32)
    compiled = []
    # --mosaic: the Mosaic GPU kernel (sparse_mla_mosaic) alone, on each of its schedules.
    variants = [dict(impl="mosaic", schedule=schedule) for schedule in ("owner", "seesaw")] if "--mosaic" in sys.argv \
        else VARIANTS
    for opts in variants:
        opts = dict(opts)
        mla.SCHEDULE = opts.pop("schedule", "owner")  # read when the kernel is traced
        kernel = sparse_mla_attention if opts.get("impl") == "mosaic" else sparse_mla_attention_pallas
        f = jax.jit(lambda q, c, i, opts=opts, kernel=kernel: kernel(q, c, i, scale=0.04, **opts))
        compiled.append(f.lower(q, cache, idx).compile())
    for n, (opts, f) in enumerate(zip(variants, compiled), 1):
        jax.block_until_ready(f(q, cache, idx))
        print(f"launch {n}: sparse MLA decode B={B} {opts or 'defaults'}", flush=True)


if __name__ == "__main__":
    main()
