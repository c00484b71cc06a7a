"""Where the Mosaic GPU sparse MLA decode kernel (`pallas_kernels/sparse_mla_mosaic.py`) goes wrong, if it does: inputs
whose answer each part of the kernel alone decides, and the error of each warpgroup's output columns on them. On a
GPU machine with jax >= 0.11:

    PYTHONPATH=. python bench/lab/mosaic_mla_probe.py

| case | answer | what a wrong answer points at |
|---|---|---|
| one key | the listed key's value row | the gather (a row, its swizzle), P V, the normalisation |
| uniform | the mean of the listed rows (q = 0: scores all 0) | the gather of whole blocks, both slots, the row sums |
| argmax | the one key whose row q points at (large scale) | S = Q Kᵀ (operand layouts), the masking |
| holes | as uniform, over the rows that are not −1 | the −1 rows' zeros and masking |
| split | uniform with the list split over 4 programs | the split outputs' log-sum-exp and their combine |

The first OWNER_COLUMNS columns are warpgroup 0's (it also owns the softmax), the rest warpgroup 1's (P and the
rescale from shared memory). Each case prints the largest error of each warpgroup's columns, over queries and heads,
and the first query that fails.
"""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sparse_mla_mosaic import OWNER_COLUMNS, sparse_mla_decode_mosaic

T, H, K, ROWS = 8, 128, 512, 4096
TOLERANCE = 2e-2  # bf16 values, P rounded to bf16 before P V


def cases(seed=0):
    rng = np.random.default_rng(seed)
    cache = np.asarray(jnp.asarray(rng.standard_normal((ROWS, 576)), jnp.bfloat16), np.float32)  # as stored
    idx = np.stack([rng.permutation(ROWS)[:K] for _ in range(T)]).astype(np.int32)
    values = cache[:, :512]
    q_random = rng.standard_normal((T, H, 576)).astype(np.float32)

    listed = np.ones(T, np.int32)
    yield "one key", q_random, cache, idx, listed, 0.04, None, values[idx[:, 0]][:, None].repeat(H, 1)

    listed = np.full(T, K, np.int32)
    listed[:3] = [K - 1, 65, 64]
    mean = np.stack([values[idx[t, :listed[t]]].mean(0) for t in range(T)])
    zeros = np.zeros_like(q_random)
    yield "uniform", zeros, cache, idx, listed, 0.04, None, mean[:, None].repeat(H, 1)

    winner = rng.integers(0, K, T)
    target = cache[idx[np.arange(T), winner]]  # [T, 576]
    q_point = np.repeat(target[:, None] / np.linalg.norm(target, axis=-1)[:, None, None], H, 1)
    yield "argmax", q_point, cache, idx, np.full(T, K, np.int32), 400.0, None, \
        values[idx[np.arange(T), winner]][:, None].repeat(H, 1)

    holes = idx.copy()
    holes[:, 1::3] = -1
    mean = np.stack([values[row[row >= 0]].mean(0) for row in holes])
    yield "holes", zeros, cache, holes, np.full(T, K, np.int32), 0.04, None, mean[:, None].repeat(H, 1)

    mean = np.stack([values[idx[t]].mean(0) for t in range(T)])
    yield "split", zeros, cache, idx, np.full(T, K, np.int32), 0.04, 4, mean[:, None].repeat(H, 1)


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; T={T} H={H} top-{K} over {ROWS} rows")
    print(f"{'case':<10} {'warpgroup 0':>11} {'warpgroup 1':>13}  first failing query")
    for name, q, cache, idx, listed, scale, splits, want in cases():
        bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
        want = np.asarray(bf16(want), np.float32)
        try:
            got = jax.jit(lambda q, c, i, n: sparse_mla_decode_mosaic(q, c, i, scale=scale, listed=n,
                                                                      num_splits=splits))(
                bf16(q), bf16(cache), jnp.asarray(idx), jnp.asarray(listed))
            got = np.asarray(got, np.float32)
        except Exception:  # noqa: BLE001 - the probe reports and goes on to the next case
            # The error's own lines (the traceback's end) say most: a lowering error names the op.
            lines = [line for line in traceback.format_exc().strip().splitlines()
                     if not line.startswith(("-----", "For simplicity"))]
            print(f"{name:<10} failed: " + "\n    ".join(lines[-6:]))
            continue
        error = np.abs(got - want) / np.maximum(np.abs(want).max(), 1e-6)
        halves = [error[..., :OWNER_COLUMNS].max(), error[..., OWNER_COLUMNS:].max()]
        bad = np.flatnonzero(error.max(axis=(1, 2)) > TOLERANCE)
        where = "none" if not bad.size else (
            f"query {bad[0]}: heads {np.flatnonzero(error[bad[0]].max(axis=1) > TOLERANCE)[:8].tolist()}")
        print(f"{name:<10} {halves[0]:>11.2e} {halves[1]:>13.2e}  {where}")


if __name__ == "__main__":
    main()
