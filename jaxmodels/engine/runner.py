"""The jitted runner: one executable per bucket, compiled ahead of time, each call donating the caches.

Executables are compiled with `jit(...).lower(...).compile()`: calling one with a shape it was not built for is an
error instead of a silent recompilation, so "nothing compiles after warm-up" holds by construction.

A step is two executables sent back to back: the model's forward for the bucket (-> logits, caches) and a small
sampler (-> tokens, each stored at its request's slot in `last_tokens`, where the next decode reads its input).
The host picks the sampler, greedy or full, from the batch (see sampler.py): the step programs hold no XLA control
flow, which on the GPU would make the launching thread wait for the device.

On a ("dp", "tp") mesh both executables run inside a `shard_map` that is manual over "dp" (and leaves "tp" to the
compiler): each dp group of devices holds its own slice of the caches' pools, of `last_tokens` and of the batch,
which are whole single-group pools and batches with group-local slot and page ids, so the model's layers run as on
one device. Only MLP / MoE layers, whose weights are split over all devices, exchange tokens between groups (see
jaxmodels.layers.group_parallel). Every group runs the same bucket; an idle group runs padding rows.
"""

import concurrent.futures
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmodels.engine import sampler
from jaxmodels.engine.batch import decode_batch, extend_batch
from jaxmodels.engine.buckets import bucket_for
from jaxmodels.engine.cache import allocate_caches
from jaxmodels.engine.scheduler import SlotTables
from jaxmodels.step_context import StepKind

log = logging.getLogger("jaxmodels.engine")

SAMPLERS = ("greedy", "sample")


DP = "dp"


def _forward_fn(step, kind: StepKind, param_names: list[str], dp_axis: str | None):
    """The forward executable of `kind`: logits of each sequence's (extend) or row's (decode) last token. A decode
    row's input is the token its slot sampled last, so the host never sends it (and may send this step before the
    previous step's tokens have come back).

    Params come in as a flat list (in `param_names` order) and become the step's {path: array} inside the trace:
    flattening a dict sorts its keys on every call, which doubled the launch cost at a 9B model's 600 arrays.
    """

    def run(param_values, caches, last_tokens, batch):
        params = dict(zip(param_names, param_values))
        if kind is StepKind.EXTEND:
            return step.extend(params, caches, batch, dp_axis)
        return step.decode(params, caches, batch, last_tokens[batch.slot_ids], dp_axis)

    return run


def _sampler_fn(mode: str):
    def run(logits, last_tokens, knobs):
        if mode == "greedy":
            tokens = sampler.greedy(logits)
        else:
            tokens = sampler.sample(logits, knobs.temperature, knobs.top_k, knobs.top_p, knobs.seed, knobs.step)
        return tokens, last_tokens.at[knobs.slot_ids].set(tokens)

    return run


def _group_axis_only(spec: PartitionSpec) -> PartitionSpec:
    """The part of a full mesh PartitionSpec that a shard_map manual over "dp" states: per dimension, "dp" where
    the dimension is split over it (alone or first, as in ("dp", "tp")), else None; "tp" stays the compiler's."""
    def keep(axes):
        names = axes if isinstance(axes, tuple) else (axes,)
        return DP if names and names[0] == DP else None

    return PartitionSpec(*(keep(axes) for axes in spec))


def _by_groups(shapes: list, dp: int) -> list:
    """Per-layer cache shapes of one group's pools -> those of `dp` groups' pools stacked on the pool axis (the
    leading one of every cache array: pages or slots)."""
    def stacked(s):
        return jax.ShapeDtypeStruct((dp * s.shape[0], *s.shape[1:]), s.dtype)

    return jax.tree.map(stacked, shapes)


def _concat_groups(parts: list):
    """[(batch, knobs)] of each group -> one (batch, knobs) with the groups' rows back to back."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *arrays: np.concatenate(arrays), *parts)


class Runner:
    def __init__(self, step, sizes, *, decode_sizes, prefill_sizes, max_seqs_per_extend: int, mesh=None):
        """`sizes` are one dp group's pools. With a `mesh`, params and caches are sharded by `sharding`'s rules
        (cache pools over "dp") and the executables keep the caches' shardings from step to step."""
        self.step, self.sizes = step, sizes
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs = max_seqs_per_extend
        self.dp = mesh.shape[DP] if mesh is not None else 1
        cache_shapes = _by_groups(step.cache_shapes(sizes), self.dp)
        params = step.take_params()  # placed here (sharded over the mesh, if any); the step keeps no reference
        self.param_names = list(params)
        self.last_tokens = jnp.zeros((self.dp * sizes.num_slots,), jnp.int32)
        self._to_devices = lambda tree: tree  # numpy batches go to the executables as they are
        if mesh is None:
            self.params = [params[name] for name in self.param_names]
            self.caches = allocate_caches(cache_shapes)
            self._forward = {kind: jax.jit(_forward_fn(step, kind, self.param_names, None), donate_argnums=1)
                             for kind in StepKind}
            self._samplers = {mode: jax.jit(_sampler_fn(mode), donate_argnums=1) for mode in SAMPLERS}
        else:
            self._shard_over(mesh, params, cache_shapes)
        # Compiled executables: (StepKind, bucket) -> forward; (rows, sampler mode) -> sampler.
        self._compiled: dict[tuple, object] = {}
        self._example_tables = SlotTables(1, sizes.pages_per_seq)

    def _shard_over(self, mesh, params: dict, cache_shapes) -> None:
        from sharding import cache_partition_specs, param_partition_specs

        def shardings(specs):
            return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))

        param_specs = param_partition_specs(params, self.step.param_axes, mesh, self.step.param_blocks)
        self.params = [jax.device_put(params[name], NamedSharding(mesh, param_specs[name]))
                       for name in self.param_names]
        cache_specs = cache_partition_specs(cache_shapes, mesh)
        cache_shardings = shardings(cache_specs)
        self.caches = allocate_caches(cache_shapes, cache_shardings)
        by_group = NamedSharding(mesh, PartitionSpec(DP))
        self.last_tokens = jax.device_put(self.last_tokens, by_group)
        if jax.process_count() > 1:  # each process feeds its own devices' rows of the host's batch
            self._to_devices = lambda tree: jax.tree.map(
                lambda a: jax.make_array_from_callback(a.shape, by_group, lambda index: a[index]), tree)
        else:  # one transfer of the whole batch, split by rows; numpy arguments would take jit's slow path, one by one
            self._to_devices = lambda tree: jax.device_put(tree, by_group)
        group_specs = jax.tree.map(_group_axis_only, cache_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        rows = PartitionSpec(DP)
        forward_specs = dict(in_specs=([_group_axis_only(param_specs[name]) for name in self.param_names],
                                       group_specs, rows, rows), out_specs=(rows, group_specs))
        # Pinning the caches' output shardings keeps every step's inputs on the layout it was compiled for.
        self._forward = {
            kind: jax.jit(jax.shard_map(_forward_fn(self.step, kind, self.param_names, DP), mesh=mesh,
                                        axis_names=frozenset({DP}), check_vma=False, **forward_specs),
                          donate_argnums=1, out_shardings=(by_group, cache_shardings))
            for kind in StepKind}
        self._samplers = {
            mode: jax.jit(jax.shard_map(_sampler_fn(mode), mesh=mesh, in_specs=(rows, rows, rows),
                                        out_specs=(rows, rows), axis_names=frozenset({DP}), check_vma=False),
                          donate_argnums=1, out_shardings=(by_group, by_group))
            for mode in SAMPLERS}

    def _example(self, kind, n):
        """An all-padding (batch, sampling knobs) of bucket n for every group."""
        if kind == StepKind.EXTEND:
            part = extend_batch([], n, self.max_seqs, self._example_tables)
        else:
            part = decode_batch([], n, self._example_tables)
        return _concat_groups([part] * self.dp)

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
        logits = jax.ShapeDtypeStruct((self.dp * first, self.step.config.vocab_size), jnp.float32)
        _, knobs = self._example(StepKind.DECODE, first)
        return self._samplers[second].lower(logits, self.last_tokens, knobs)

    def _executable(self, job):
        if job not in self._compiled:  # only without warm-up
            self._compiled[job] = self._lower(job).compile()
        return self._compiled[job]

    def _run(self, kind, n, batch, knobs):
        """Send one step (forward, then sampler) to the device; returns its sampled tokens as a device array, not
        waited for."""
        batch, knobs = self._to_devices((batch, knobs))
        logits, self.caches = self._executable((kind, n))(self.params, self.caches, self.last_tokens, batch)
        mode = "greedy" if knobs.greedy else "sample"
        tokens, self.last_tokens = self._executable((logits.shape[0] // self.dp, mode))(logits, self.last_tokens, knobs)
        return tokens

    @staticmethod
    def read(tokens) -> np.ndarray:
        """A step's sampled tokens on the host (waits for them); from every process's devices in a multi-process
        job."""
        if tokens.is_fully_addressable:
            return np.asarray(tokens)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(tokens, tiled=True))

    def launch(self, kind: StepKind, works: list, tables: list) -> tuple[object, int]:
        """Send one step of every dp group's work (works[g]: group g's chunks or requests, [] when idle; tables[g]
        its slot tables) -> (the sampled tokens as a device array, not waited for; rows per group in it)."""
        if kind is StepKind.EXTEND:
            n = bucket_for(self.prefill_sizes, max(sum(chunk.length for chunk in chunks) for chunks in works))
            parts = [extend_batch(chunks, n, self.max_seqs, t) for chunks, t in zip(works, tables)]
            rows = self.max_seqs
        else:
            n = bucket_for(self.decode_sizes, max(map(len, works)))
            parts = [decode_batch(requests, n, t) for requests, t in zip(works, tables)]
            rows = n
        return self._run(kind, n, *_concat_groups(parts)), rows
