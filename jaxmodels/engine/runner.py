"""The jitted runner: one executable per bucket, compiled ahead of time, each call donating the caches.

Executables are compiled with `jit(...).lower(...).compile()`: calling one with a shape it was not built for is an
error instead of a silent recompilation, so "nothing compiles after warm-up" holds by construction.
"""

import concurrent.futures
import logging
import os
import time

import jax
import numpy as np

from jaxmodels.engine.batch import decode_batch, extend_batch
from jaxmodels.engine.buckets import bucket_for
from jaxmodels.engine.cache import allocate_caches
from jaxmodels.engine.sampler import sample

log = logging.getLogger("jaxmodels.engine")

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "step")


def _with_sampling(step_fn):
    def run(params, caches, batch):
        logits, caches = step_fn(params, caches, batch)
        return sample(logits, *(batch[k] for k in _SAMPLING_KEYS)), caches

    return run


class Runner:
    def __init__(self, step, sizes, *, decode_sizes, prefill_sizes, max_seqs_per_extend: int, mesh=None):
        """With a `mesh`, params and caches are sharded by `sharding`'s rules and the executables keep the caches'
        shardings from step to step (the batch metadata and sampled tokens are replicated)."""
        self.step, self.sizes = step, sizes
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs = max_seqs_per_extend
        cache_shapes = step.cache_shapes(sizes)
        jit_options = {"donate_argnums": 1}
        if mesh is None:
            self.params = step.params
            self.caches = allocate_caches(cache_shapes)
        else:
            from jax.sharding import NamedSharding, PartitionSpec

            from sharding import cache_partition_specs, shard_params

            self.params = shard_params(step.params, mesh)
            cache_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                           cache_partition_specs(cache_shapes, mesh),
                                           is_leaf=lambda x: isinstance(x, PartitionSpec))
            self.caches = allocate_caches(cache_shapes, cache_shardings)
            # Pinning the caches' output shardings keeps every step's inputs on the layout it was compiled for.
            jit_options["out_shardings"] = (NamedSharding(mesh, PartitionSpec()), cache_shardings)
        self._jit_extend = jax.jit(_with_sampling(step.extend), **jit_options)
        self._jit_decode = jax.jit(_with_sampling(step.decode), **jit_options)
        self._tables: dict[str, dict[int, object]] = {"extend": {}, "decode": {}}

    def _extend_example(self, num_tokens):
        return extend_batch([], num_tokens, self.max_seqs, self.sizes.pages_per_seq)

    def _decode_example(self, rows):
        return decode_batch([], rows, self.sizes.pages_per_seq)

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket. An all-padding batch has the exact shapes and dtypes of a real one.

        Tracing runs here one bucket after another; XLA compiles them on a thread per core, which releases the GIL
        (2x faster on the 2-core CI machine).
        """
        from tqdm.auto import tqdm

        jobs = [("extend", n) for n in self.prefill_sizes] + [("decode", n) for n in self.decode_sizes]
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool, \
                tqdm(total=len(jobs), desc="compiling buckets", disable=not progress) as bar:
            futures = {pool.submit(self._lower(kind, n).compile): (kind, n) for kind, n in jobs}
            for future in concurrent.futures.as_completed(futures):
                kind, n = futures[future]
                self._tables[kind][n] = future.result()
                bar.update()
        log.info("compiled %d buckets in %.1f s (prefill tokens %s; decode batch %s)", len(jobs),
                 time.perf_counter() - start, self.prefill_sizes, self.decode_sizes)

    def _lower(self, kind, n):
        if kind == "extend":
            return self._jit_extend.lower(self.params, self.caches, self._extend_example(n))
        return self._jit_decode.lower(self.params, self.caches, self._decode_example(n))

    def _executable(self, kind, n):
        table = self._tables[kind]
        if n not in table:  # only without warm-up
            table[n] = self._lower(kind, n).compile()
        return table[n]

    def run_extend(self, chunks) -> np.ndarray:
        n = bucket_for(self.prefill_sizes, sum(length for _, _, length in chunks))
        batch = extend_batch(chunks, n, self.max_seqs, self.sizes.pages_per_seq)
        tokens, self.caches = self._executable("extend", n)(self.params, self.caches, batch)
        return np.asarray(tokens)[: len(chunks)]

    def run_decode(self, requests) -> np.ndarray:
        n = bucket_for(self.decode_sizes, len(requests))
        batch = decode_batch(requests, n, self.sizes.pages_per_seq)
        tokens, self.caches = self._executable("decode", n)(self.params, self.caches, batch)
        return np.asarray(tokens)[: len(requests)]
