"""The jitted runner: one executable per bucket, compiled ahead of time, each call donating the caches.

Executables are compiled with `jit(...).lower(...).compile()`: calling one with a shape it was not built for is an
error instead of a silent recompilation, so "nothing compiles after warm-up" holds by construction.

A step is two executables sent back to back: the model's forward for the bucket (-> logits, caches) and a small
sampler (-> tokens, each stored at its request's slot in `last_tokens`, where the next decode reads its input).
The host picks the sampler, greedy or full, from the batch (see sampler.py): the step programs hold no XLA control
flow, which on the GPU would make the launching thread wait for the device.
"""

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp

from jaxmodels.engine import sampler
from jaxmodels.engine.batch import decode_batch, extend_batch
from jaxmodels.engine.buckets import bucket_for
from jaxmodels.engine.cache import allocate_caches
from jaxmodels.engine.scheduler import SlotTables
from jaxmodels.step_context import StepKind

log = logging.getLogger("jaxmodels.engine")

SAMPLERS = ("greedy", "sample")


def _forward_fn(step, kind: StepKind, param_names: list[str]):
    """The forward executable of `kind`: logits of each sequence's (extend) or row's (decode) last token. A decode
    row's input is the token its slot sampled last, so the host never sends it (and may send this step before the
    previous step's tokens have come back).

    Params come in as a flat list (in `param_names` order) and become the step's {path: array} inside the trace:
    flattening a dict sorts its keys on every call, which doubled the launch cost at a 9B model's 600 arrays.
    """

    def run(param_values, caches, last_tokens, batch):
        params = dict(zip(param_names, param_values))
        if kind is StepKind.EXTEND:
            return step.extend(params, caches, batch)
        return step.decode(params, caches, batch, last_tokens[batch.slot_ids])

    return run


def _sampler_fn(mode: str):
    def run(logits, last_tokens, knobs):
        if mode == "greedy":
            tokens = sampler.greedy(logits)
        else:
            tokens = sampler.sample(logits, knobs.temperature, knobs.top_k, knobs.top_p, knobs.seed, knobs.step)
        return tokens, last_tokens.at[knobs.slot_ids].set(tokens)

    return run


class Runner:
    def __init__(self, step, sizes, *, decode_sizes, prefill_sizes, max_seqs_per_extend: int, mesh=None):
        """With a `mesh`, params and caches are sharded by `sharding`'s rules and the executables keep the caches'
        shardings from step to step (the batch metadata and sampled tokens are replicated)."""
        self.step, self.sizes = step, sizes
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs = max_seqs_per_extend
        cache_shapes = step.cache_shapes(sizes)
        forward_options = {"donate_argnums": 1}
        sampler_options = {"donate_argnums": 1}
        self.param_names = list(step.params)
        if mesh is None:
            self.params = [step.params[name] for name in self.param_names]
            self.caches = allocate_caches(cache_shapes)
        else:
            from jax.sharding import NamedSharding, PartitionSpec

            from sharding import cache_partition_specs, shard_params

            sharded = shard_params(step.params, mesh)
            self.params = [sharded[name] for name in self.param_names]
            cache_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                                           cache_partition_specs(cache_shapes, mesh),
                                           is_leaf=lambda x: isinstance(x, PartitionSpec))
            self.caches = allocate_caches(cache_shapes, cache_shardings)
            # Pinning the caches' output shardings keeps every step's inputs on the layout it was compiled for.
            replicated = NamedSharding(mesh, PartitionSpec())
            forward_options["out_shardings"] = (replicated, cache_shardings)
            sampler_options["out_shardings"] = (replicated, replicated)
        self.last_tokens = jnp.zeros((sizes.num_slots,), jnp.int32)
        if mesh is not None:
            self.last_tokens = jax.device_put(self.last_tokens, replicated)
        self._forward = {kind: jax.jit(_forward_fn(step, kind, self.param_names), **forward_options)
                         for kind in StepKind}
        self._samplers = {mode: jax.jit(_sampler_fn(mode), **sampler_options) for mode in SAMPLERS}
        # Compiled executables: (StepKind, bucket) -> forward; (rows, sampler mode) -> sampler.
        self._compiled: dict[tuple, object] = {}
        self._example_tables = SlotTables(1, sizes.pages_per_seq)

    def _example(self, kind, n):
        """An all-padding (batch, sampling knobs) of bucket n."""
        if kind == StepKind.EXTEND:
            return extend_batch([], n, self.max_seqs, self._example_tables)
        return decode_batch([], n, self._example_tables)

    def _jobs(self) -> list[tuple]:
        forwards = ([(StepKind.EXTEND, n) for n in self.prefill_sizes]
                    + [(StepKind.DECODE, n) for n in self.decode_sizes])
        rows = sorted({self.max_seqs, *self.decode_sizes})
        return forwards + [(n, mode) for n in rows for mode in SAMPLERS]

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket's forward and every row count's samplers. An all-padding batch has the exact shapes
        and dtypes of a real one.

        Tracing runs here one executable after another; XLA compiles them on a thread per core, which releases the
        GIL (2x faster on the 2-core CI machine).
        """
        from tqdm.auto import tqdm

        jobs = self._jobs()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool, \
                tqdm(total=len(jobs), desc="compiling buckets", disable=not progress) as bar:
            futures = {pool.submit(self._lower(job).compile): job for job in jobs}
            for future in concurrent.futures.as_completed(futures):
                self._compiled[futures[future]] = future.result()
                bar.update()
        log.info("compiled %d executables in %.1f s (prefill tokens %s; decode batch %s; greedy and full samplers)",
                 len(jobs), time.perf_counter() - start, self.prefill_sizes, self.decode_sizes)

    def _lower(self, job):
        first, second = job
        if first in (StepKind.EXTEND, StepKind.DECODE):
            batch, _ = self._example(first, second)
            return self._forward[first].lower(self.params, self.caches, self.last_tokens, batch)
        logits = jax.ShapeDtypeStruct((first, self.step.config.vocab_size), jnp.float32)
        _, knobs = self._example(StepKind.DECODE, first)
        return self._samplers[second].lower(logits, self.last_tokens, knobs)

    def _executable(self, job):
        if job not in self._compiled:  # only without warm-up
            self._compiled[job] = self._lower(job).compile()
        return self._compiled[job]

    def _run(self, kind, n, batch, knobs):
        """Send one step (forward, then sampler) to the device; returns its sampled tokens as a device array, not
        waited for."""
        logits, self.caches = self._executable((kind, n))(self.params, self.caches, self.last_tokens, batch)
        mode = "greedy" if knobs.greedy else "sample"
        tokens, self.last_tokens = self._executable((logits.shape[0], mode))(logits, self.last_tokens, knobs)
        return tokens

    def launch_extend(self, chunks, tables):
        n = bucket_for(self.prefill_sizes, sum(chunk.length for chunk in chunks))
        return self._run(StepKind.EXTEND, n, *extend_batch(chunks, n, self.max_seqs, tables))

    def launch_decode(self, requests, tables):
        n = bucket_for(self.decode_sizes, len(requests))
        return self._run(StepKind.DECODE, n, *decode_batch(requests, n, tables))
