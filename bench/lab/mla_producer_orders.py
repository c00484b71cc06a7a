"""The Mosaic sparse MLA decode kernel's producer orders side by side (issue 42): the kernel at 253bc7c (index loads
in the gather), keys loaded a block ahead with each block published before the next gather (the order of 253bc7c),
and keys loaded ahead with each gather issued before the previous block's publication (two gathers in flight).
B = 32 / 128 queries, top-2048, 128 heads, one executable of several operand sets (dsa_kernels' timing).

    PYTHONPATH=.:bench python bench/lab/mla_producer_orders.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "bench")
from dsa_kernels import sets_for, timed  # noqa: E402
from jaxmodels.benchmark_floors import COPY_BANDWIDTH  # noqa: E402
import pallas_kernels.sparse_mla_mosaic as mla  # noqa: E402

sys.path.insert(0, "bench/lab")
import _mla_mosaic_253bc7c as old  # noqa: E402


def main():
    H, k, rows = 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows, 576)).astype(jnp.bfloat16)
    for B in (32, 128):
        bytes_ = B * k * 576 * 2 + B * H * 576 * 2 + B * H * 512 * 2 + B * k * 4
        floor = bytes_ / COPY_BANDWIDTH
        problems = [(jax.random.normal(jax.random.key(B + 2 * i), (B, H, 576)).astype(jnp.bfloat16),
                     jax.random.randint(jax.random.key(B + 2 * i + 1), (B, k), 0, rows).astype(jnp.int32))
                    for i in range(sets_for(floor, bytes_))]
        n = jnp.full((B,), k, jnp.int32)
        want = jax.jit(lambda c, q, i: old.sparse_mla_decode_mosaic(q, c, i, scale=0.04, listed=n))(
            cache, *problems[0]).astype(jnp.float32)
        for name, kernel, order in [("253bc7c", old.sparse_mla_decode_mosaic, None),
                                    ("keys ahead, publish first", mla.sparse_mla_decode_mosaic, False),
                                    ("keys ahead, gather first", mla.sparse_mla_decode_mosaic, True),
                                    ("253bc7c again", old.sparse_mla_decode_mosaic, None)]:
            if order is not None:
                mla.GATHER_BEFORE_PUBLISH = order
            op = lambda c, q, i: kernel(q, c, i, scale=0.04, listed=n)  # noqa: E731
            got = jax.jit(op)(cache, *problems[0]).astype(jnp.float32)
            error = float(jnp.abs(got - want).max() / jnp.abs(want).max())
            seconds = timed(op, (cache,), problems)
            print(f"B={B:<4} {name:<28} {seconds * 1e3:.4f} ms  {100 * floor / seconds:5.1f}% of the byte floor  "
                  f"diff from 253bc7c {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
