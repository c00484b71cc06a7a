"""The jitted runner: one executable per bucket, compiled ahead of time, each call donating the caches.

Executables are compiled with `jit(...).lower(...).compile()`: calling one with a shape it was not built for is an
error instead of a silent recompilation, so "nothing compiles after warm-up" holds by construction.
"""

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp

from jaxmodels.engine.batch import decode_batch, extend_batch
from jaxmodels.engine.buckets import bucket_for
from jaxmodels.engine.cache import allocate_caches
from jaxmodels.engine.sampler import sample
from jaxmodels.engine.scheduler import SlotTables
from jaxmodels.precision import precision_scope

log = logging.getLogger("jaxmodels.engine")

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed", "step")


def _sampled(logits, batch):
    return sample(logits, *(batch[k] for k in _SAMPLING_KEYS))


def _extend_fn(step):
    """The extend executable: the step, sampling, and each sequence's sampled token stored at its slot."""

    def run(params, caches, last_tokens, batch):
        with precision_scope(step.matmul_precision):
            logits, caches = step.extend(params, caches, batch)
            sampled = _sampled(logits, batch)
        return sampled, caches, last_tokens.at[batch["slot_ids"]].set(sampled)

    return run


def _decode_fn(step):
    """The decode executable: each row's input is the token its slot sampled last, so the host never has to send
    it (and may send this step before the previous step's tokens have come back)."""

    def run(params, caches, last_tokens, batch):
        tokens = last_tokens[batch["slot_ids"]]
        with precision_scope(step.matmul_precision):
            logits, caches = step.decode(params, caches, {**batch, "tokens": tokens})
            sampled = _sampled(logits, batch)
        return sampled, caches, last_tokens.at[batch["slot_ids"]].set(sampled)

    return run


class Runner:
    def __init__(self, step, sizes, *, decode_sizes, prefill_sizes, max_seqs_per_extend: int, mesh=None):
        """With a `mesh`, params and caches are sharded by `sharding`'s rules and the executables keep the caches'
        shardings from step to step (the batch metadata and sampled tokens are replicated)."""
        self.step, self.sizes = step, sizes
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs = max_seqs_per_extend
        cache_shapes = step.cache_shapes(sizes)
        jit_options = {"donate_argnums": (1, 2)}
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
            replicated = NamedSharding(mesh, PartitionSpec())
            jit_options["out_shardings"] = (replicated, cache_shardings, replicated)
        self.last_tokens = jnp.zeros((sizes.num_slots,), jnp.int32)
        if mesh is not None:
            self.last_tokens = jax.device_put(self.last_tokens, replicated)
        self._jit_extend = jax.jit(_extend_fn(step), **jit_options)
        self._jit_decode = jax.jit(_decode_fn(step), **jit_options)
        self._tables: dict[str, dict[int, object]] = {"extend": {}, "decode": {}}
        self._example_tables = SlotTables(1, sizes.pages_per_seq)

    def _extend_example(self, num_tokens):
        return extend_batch([], num_tokens, self.max_seqs, self._example_tables)

    def _decode_example(self, rows):
        return decode_batch([], rows, self._example_tables)

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
            return self._jit_extend.lower(self.params, self.caches, self.last_tokens, self._extend_example(n))
        return self._jit_decode.lower(self.params, self.caches, self.last_tokens, self._decode_example(n))

    def _executable(self, kind, n):
        table = self._tables[kind]
        if n not in table:  # only without warm-up
            table[n] = self._lower(kind, n).compile()
        return table[n]

    def _run(self, kind, n, batch):
        """Send one step to the device; returns its sampled tokens as a device array (not waited for)."""
        tokens, self.caches, self.last_tokens = self._executable(kind, n)(self.params, self.caches,
                                                                          self.last_tokens, batch)
        return tokens

    def launch_extend(self, chunks, tables):
        n = bucket_for(self.prefill_sizes, sum(length for _, _, length in chunks))
        return self._run("extend", n, extend_batch(chunks, n, self.max_seqs, tables))

    def launch_decode(self, requests, tables):
        n = bucket_for(self.decode_sizes, len(requests))
        return self._run("decode", n, decode_batch(requests, n, tables))
