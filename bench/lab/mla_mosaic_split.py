"""Where the Mosaic sparse MLA decode kernel's time goes, by taking parts out (issue 42): the whole kernel, its
compute alone (the producer gathers nothing, so each block is published at once and the warpgroups compute on
whatever the slots hold) and its gathers alone (no wgmma: S is zeros and P V adds nothing; the softmax and P's
stores stay). If the whole kernel takes about as long as one part, that part sets the pace; if it takes about
their sum, the two do not overlap. B = 32 / 128 queries, top-2048, 128 heads, dsa_kernels' timing.

    PYTHONPATH=. python bench/lab/mla_mosaic_split.py        # bash bench/lab/h200_runs.sh mla_split
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "bench")
from dsa_kernels import sets_for, timed  # noqa: E402
from jaxmodels.benchmark_floors import COPY_BANDWIDTH  # noqa: E402
import pallas_kernels.sparse_mla_mosaic as mla  # noqa: E402

KERNEL_OPS = mla._Compiled


class ComputeOnly(KERNEL_OPS):
    """No rows copied: `wait_for_gathers` finds nothing in flight, and each block is published at once."""

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref):
        del cache_gmem, indices_gmem, start, keys, rows_ref, index_ref


class GathersOnly(KERNEL_OPS):
    """No tensor-core work: S is zeros and P V leaves the accumulator as it is."""

    def matmul_transposed(self, a_ref, b_ref):
        return self.with_layout(jnp.zeros((a_ref.shape[0], b_ref.shape[0]), jnp.float32), self.plgpu.Layout.WGMMA)

    def accumulate(self, acc, a, b_ref):
        del a, b_ref
        return acc


def main():
    H, k, rows = 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows, 576)).astype(jnp.bfloat16)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; top-{k}, {H} heads")
    for B in (32, 128):
        bytes_ = B * k * 576 * 2 + B * H * 576 * 2 + B * H * 512 * 2 + B * k * 4
        floor = bytes_ / COPY_BANDWIDTH
        problems = [(jax.random.normal(jax.random.key(B + 2 * i), (B, H, 576)).astype(jnp.bfloat16),
                     jax.random.randint(jax.random.key(B + 2 * i + 1), (B, k), 0, rows).astype(jnp.int32))
                    for i in range(sets_for(floor, bytes_))]
        n = jnp.full((B,), k, jnp.int32)
        for name, ops in [("whole kernel", KERNEL_OPS), ("compute only", ComputeOnly), ("gathers only", GathersOnly)]:
            mla._Compiled = ops
            try:
                seconds = timed(lambda c, q, i: mla.sparse_mla_decode_mosaic(q, c, i, scale=0.04, listed=n),
                                (cache,), problems)
            finally:
                mla._Compiled = KERNEL_OPS
            print(f"B={B:<4} {name:<13} {seconds * 1e3:.4f} ms  ({100 * floor / seconds:.1f}% of the byte floor)",
                  flush=True)


if __name__ == "__main__":
    main()
