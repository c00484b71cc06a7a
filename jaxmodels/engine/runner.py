"""The jitted runner: one executable per bucket, compiled ahead of time, each call donating the caches.

Executables are compiled with `jit(...).lower(...).compile()`: calling one with a shape it was not built for is an
error instead of a silent recompilation, so "nothing compiles on the step path" holds by construction. Which
buckets exist and which are compiled yet are apart: a step pads up to the smallest bucket that is ready
(`mark_ready`), while the others may still be compiling in the background (engine.warmup).

A step is two executables sent back to back: the model's forward for the bucket (-> logits, caches) and a small
sampler (-> tokens, each stored at its request's slot in `last_tokens`, where the next decode reads its input).
The host picks the sampler, greedy or full, from the batch (see sampler.py): the step programs hold no XLA control
flow, which on the GPU would make the launching thread wait for the device.

With speculative decoding (engine.speculative) an extend step is three executables (the forward, which also returns
the hidden states; the sampler; the MTP layer's pass and drafts, kept per slot in `drafts`), and a decode step is
one VERIFY executable per bucket and sampler kind (verification, acceptance, commit and the next drafts).

With `launch_thread`, the device half of each step (the batch's transfers and the executables' calls, whose launch
on the GPU costs about a millisecond a step: PJRT's Execute and the CUDA graph's launch) runs on one thread of its
own, in the order the steps were sent, and `launch` returns a future of the tokens: the scheduling thread goes on to
read the step before and account for it meanwhile. The batches are built on the calling thread, into fresh arrays, so
the launch thread reads nothing the scheduler changes afterwards; only that thread touches the caches, `last_tokens`
and `drafts` while steps are in flight, and a step's future is done before its tokens are read. It is on by default
in a single-process job: on one H200 it took the scheduling thread's host time of a Nano-9B-class decode step at
256 sequences from 3.2 to 1.1 ms (12% -> 4% of the step) and a Nano-30B-class step at one sequence from 3.12 to
2.77 ms (docs/BENCHMARKS.md).

On a ("dp", "tp") mesh both executables run inside a `shard_map` that is manual over "dp" (and leaves "tp" to the
compiler): each dp group of devices holds its own slice of the caches' pools, of `last_tokens` and of the batch,
which are whole single-group pools and batches with group-local slot and page ids, so the model's layers run as on
one device. Only MLP / MoE layers, whose weights are split over all devices, exchange tokens between groups (see
jaxmodels.layers.group_parallel). Every group runs the same bucket; an idle group runs padding rows. The layers run
their Pallas kernels on arrays split over "tp" manual over "tp" too (jaxmodels.layers.tensor_parallel, reading the
layouts `record_tp_specs` puts on the step's params): XLA cannot split a custom call and would gather its operands.
"""

import concurrent.futures
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmodels.engine import sampler
from jaxmodels.engine.batch import (adjust_knobs, decode_batch, extend_adjust_knobs, extend_batch, next_tokens,
                                    verify_batch)
from jaxmodels.engine.cache import allocate_caches
from jaxmodels.engine.grammar import bitmask_words
from jaxmodels.engine.programs import (ADJUSTED, ADJUSTED_GREEDY, DRAFT, EXTEND_HIDDEN, SAMPLERS, StepPrograms,
                                       concat_groups)
from jaxmodels.engine.request import MAX_LOGPROBS
from jaxmodels.engine.speculative import DraftState
from jaxmodels.layers.tensor_parallel import TP
from jaxmodels.step_context import StepKind

log = logging.getLogger("jaxmodels.engine")

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


def _extend_hidden_fn(step, param_names, dp_axis):
    def run(param_values, caches, batch):
        return step.extend_hidden(dict(zip(param_names, param_values)), caches, batch, dp_axis)

    return run


def _draft_fn(step, param_names, dp_axis):
    def run(param_values, caches, hidden, batch, next_tokens, sampled, drafts):
        new, positions, caches = step.draft_after_extend(dict(zip(param_names, param_values)), caches, hidden, batch,
                                                         next_tokens, sampled, dp_axis)
        return drafts.set(batch.slot_ids, new, positions), caches

    return run


def _verify_fn(step, param_names, mode: str, dp_axis):
    def run(param_values, caches, last_tokens, drafts, batch, knobs):
        return step.verify(dict(zip(param_names, param_values)), caches, last_tokens, drafts, batch, knobs,
                           greedy=mode == "greedy", dp_axis=dp_axis)

    return run


def _sampler_fn(mode: str):
    def run(logits, last_tokens, knobs):
        if mode == "greedy":
            tokens = sampler.greedy(logits)
        else:
            tokens = sampler.sample(logits, knobs.temperature, knobs.top_k, knobs.top_p, knobs.seed, knobs.step)
        return tokens, last_tokens.at[knobs.slot_ids].set(tokens)

    return run


def _adjusted_sampler_fn(mode: str, *, extend: bool):
    """The sampler of steps with adjusted or logprob-reporting requests (sampler.sample_adjusted); an extend step's
    first records its penalized requests' tokens."""
    def run(logits, last_tokens, knobs, adjust, counts, bitmask, record=None):
        if extend:
            counts = sampler.record_tokens(counts, record)
        tokens, *logprobs, counts = sampler.sample_adjusted(logits, knobs, adjust, counts, bitmask,
                                                            greedy_only=mode == ADJUSTED_GREEDY, top=MAX_LOGPROBS)
        return (tokens, *logprobs), last_tokens.at[knobs.slot_ids].set(tokens), counts

    return run


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A step's device half (`run(*args)`: transfers and executables) with its batches built; `rows` per group of
    its results; `adjusted`: it runs the adjusting sampler (which a structured-output bitmask constrains)."""

    run: object
    args: tuple
    rows: int
    adjusted: bool = False


def _by_groups(shapes: list, dp: int) -> list:
    """Per-layer cache shapes of one group's pools -> those of `dp` groups' pools stacked on the pool axis (the
    leading one of every cache array: pages or slots)."""
    def stacked(s):
        return jax.ShapeDtypeStruct((dp * s.shape[0], *s.shape[1:]), s.dtype)

    return jax.tree.map(stacked, shapes)


def _laid_out(shapes, shardings):
    """What `jax.device_put(shapes, shardings)` would place, for a tree of ShapeDtypeStructs: the same structs with
    `shardings` (one, or a tree of them like `shapes`) and nothing allocated."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings), shapes)
    return jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes,
                        shardings)


def uses_launch_thread(requested: bool | None) -> bool:
    """Whether a runner asked for `requested` (None: the default) launches from a thread of its own. Not by default
    with several processes: each reads a step's tokens through a collective of its own (`read`) while its launch
    thread may already be sending the next step's, and two threads enqueueing collectives could order them
    differently on different processes."""
    return jax.process_count() == 1 if requested is None else requested


class Runner:
    def __init__(self, step, sizes, *, decode_sizes, prefill_sizes, max_seqs_per_extend: int, mesh=None,
                 launch_thread: bool | None = None, state_copies: int = 0):
        """`sizes` are one dp group's pools. With a `mesh`, params and caches are sharded by `sharding`'s rules
        (cache pools over "dp") and the executables keep the caches' shardings from step to step. `launch_thread`:
        see the module docstring; None turns it on in a single-process job only. `state_copies`: recurrent-state
        restores and saves per extend step (prefix caching of a hybrid, engine.batch.ExtendBatch)."""
        self.step, self.sizes = step, sizes
        self.state_copies = state_copies
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs = max_seqs_per_extend
        self.speculative = step.num_speculative_tokens
        self.dp = mesh.shape[DP] if mesh is not None else 1
        cache_shapes = _by_groups(step.cache_shapes(sizes), self.dp)
        params = step.take_params()  # placed here (sharded over the mesh, if any); the step keeps no reference
        self.param_names = list(params)
        # A model of abstract params (ShapeDtypeStructs, as nnx.eval_shape builds it) gets abstract arrays
        # throughout: programs to lower and compile for their exact shapes and layouts, nothing allocated and
        # nothing to run (jaxmodels.plan sizes full-size models this way).
        self.abstract = all(isinstance(value, jax.ShapeDtypeStruct) for value in params.values())
        build = jax.eval_shape if self.abstract else lambda make: make()
        self.last_tokens = build(lambda: jnp.zeros((self.dp * sizes.num_slots,), jnp.int32))
        # Each slot's drafts for its next verify step and its last token's position (unused without speculation).
        self.drafts = build(lambda: DraftState.zeros(self.dp * sizes.num_slots, max(self.speculative, 1)))
        # Each slot's token counts for penalized requests (none with speculation, which does not take them).
        self.token_counts = build(lambda: sampler.TokenCounts.zeros(
            self.dp * sizes.num_slots if not self.speculative else self.dp, step.config.vocab_size))
        self.record_size = max(prefill_sizes)
        self._open_masks = {}  # rows -> a device bitmask allowing every token (_open_mask)
        self._to_devices = lambda tree: tree  # numpy batches go to the executables as they are
        self._mesh = mesh
        if mesh is None:
            self.params = [params[name] for name in self.param_names]
            self.caches = cache_shapes if self.abstract else allocate_caches(cache_shapes)
        else:
            self._shard_over(mesh, params, cache_shapes)
        dp_axis = DP if mesh is not None else None
        names = self.param_names
        model_in = ("params", "caches")
        programs = {mode: self._jit(_sampler_fn(mode), ("rows",) * 3, ("rows",) * 2, donate=(1,))
                    for mode in SAMPLERS}
        for mode in ADJUSTED:
            programs[mode] = self._jit(_adjusted_sampler_fn(mode, extend=False), ("rows",) * 6, ("rows",) * 3,
                                       donate=(1, 4))
            programs["extend", mode] = self._jit(_adjusted_sampler_fn(mode, extend=True), ("rows",) * 7,
                                                 ("rows",) * 3, donate=(1, 4))
        if self.speculative:
            programs[EXTEND_HIDDEN] = self._jit(_extend_hidden_fn(step, names, dp_axis), model_in + ("rows",),
                                                ("rows", "rows", "caches"), donate=(1,))
            programs[DRAFT] = self._jit(_draft_fn(step, names, dp_axis), model_in + ("rows",) * 5,
                                        ("rows", "caches"), donate=(1, 6))
            for mode in SAMPLERS:
                programs[StepKind.VERIFY, mode] = self._jit(
                    _verify_fn(step, names, mode, dp_axis), model_in + ("rows",) * 4,
                    ("rows", "rows", "rows", "caches"), donate=(1, 2, 3))
        else:
            for kind in (StepKind.EXTEND, StepKind.DECODE):
                programs[kind] = self._jit(_forward_fn(step, kind, names, dp_axis), model_in + ("rows",) * 2,
                                           ("rows", "caches"), donate=(1,))
        # What warm-up compiles, and which buckets steps may use (engine.programs, engine.warmup).
        self.programs = StepPrograms(
            programs, dict(params=self.params, caches=self.caches, last_tokens=self.last_tokens, drafts=self.drafts,
                           token_counts=self.token_counts),
            decode_sizes=decode_sizes, prefill_sizes=prefill_sizes, max_seqs=self.max_seqs, dp=self.dp,
            state_copies=state_copies, record_size=self.record_size,
            speculative=self.speculative, pages_per_seq=sizes.pages_per_seq, vocab_size=step.config.vocab_size,
            hidden_size=step.config.hidden_size, dtype=step.dtype)
        self._launcher = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxmodels-launch")
                          if uses_launch_thread(launch_thread) else None)

    def _shard_over(self, mesh, params: dict, cache_shapes) -> None:
        from sharding import cache_partition_specs, manual_part, param_partition_specs

        def shardings(specs):
            return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                                is_leaf=lambda x: isinstance(x, PartitionSpec))

        place = _laid_out if self.abstract else jax.device_put
        param_specs = param_partition_specs(params, self.step.param_axes, mesh, self.step.param_blocks)
        self.step.record_tp_specs({name: manual_part(spec, TP) for name, spec in param_specs.items()})
        self.params = [place(params[name], NamedSharding(mesh, param_specs[name])) for name in self.param_names]
        cache_specs = cache_partition_specs(cache_shapes, mesh)
        self._cache_shardings = shardings(cache_specs)
        self.caches = (_laid_out(cache_shapes, self._cache_shardings) if self.abstract
                       else allocate_caches(cache_shapes, self._cache_shardings))
        self._by_group = by_group = NamedSharding(mesh, PartitionSpec(DP))
        self.last_tokens = place(self.last_tokens, by_group)
        self.drafts = place(self.drafts, by_group)
        self.token_counts = place(self.token_counts, by_group)
        if jax.process_count() > 1:  # each process feeds its own devices' rows of the host's batch
            self._to_devices = lambda tree: jax.tree.map(
                lambda a: jax.make_array_from_callback(a.shape, by_group, lambda index: a[index]), tree)
        else:  # one transfer of the whole batch, split by rows; numpy arguments would take jit's slow path, one by one
            self._to_devices = lambda tree: jax.device_put(tree, by_group)
        self._group_specs = {
            "params": [manual_part(param_specs[name], DP) for name in self.param_names],
            "caches": jax.tree.map(lambda spec: manual_part(spec, DP), cache_specs,
                                   is_leaf=lambda x: isinstance(x, PartitionSpec)),
            "rows": PartitionSpec(DP)}

    def _jit(self, fn, inputs: tuple[str, ...], outputs: tuple[str, ...], donate: tuple[int, ...]):
        """jit `fn`, whose arguments and results are "params" (the flat list), "caches" or "rows" (arrays or batches
        split over dp groups by their leading axis); on a mesh inside a shard_map manual over "dp", with the
        caches' output shardings pinned so every step's inputs keep the layout it was compiled for."""
        if self._mesh is None:
            return jax.jit(fn, donate_argnums=donate)
        specs = self._group_specs
        out_shardings = {"caches": self._cache_shardings, "rows": self._by_group}
        mapped = jax.shard_map(fn, mesh=self._mesh, in_specs=tuple(specs[x] for x in inputs),
                               out_specs=tuple(specs[x] for x in outputs), axis_names=frozenset({DP}),
                               check_vma=False)
        return jax.jit(mapped, donate_argnums=donate, out_shardings=tuple(out_shardings[x] for x in outputs))

    def _executable(self, job):
        return self.programs.executable(job)

    def _sample(self, logits, knobs):
        """Send the sampler for `logits`; -> the tokens (device array), stored per slot in last_tokens too."""
        mode = "greedy" if knobs.greedy else "sample"
        tokens, self.last_tokens = self._executable(("sampler", logits.shape[0] // self.dp, mode))(
            logits, self.last_tokens, knobs)
        return tokens

    def _sample_adjusted(self, kind, logits, knobs, adjust, record, bitmask):
        """Send the adjusting sampler (an extend step's records its penalized tokens first); -> (tokens, their
        logprobs, the top tokens, their logprobs) as device arrays. `bitmask`: the rows' allowed tokens (a
        future of them while the host computes them, or None: every token allowed)."""
        mode = ADJUSTED_GREEDY if knobs.greedy else ADJUSTED[1]
        extend = kind is StepKind.EXTEND
        rows = logits.shape[0] // self.dp
        job = ("sampler", rows, *(("extend",) if extend else ()), mode)
        if isinstance(bitmask, concurrent.futures.Future):
            # The forward is on its way: the engine computes the masks meanwhile (they need the previous step's
            # tokens on the host).
            bitmask = bitmask.result()
        bitmask = self._open_mask(rows) if bitmask is None else self._to_devices(bitmask)
        results, self.last_tokens, self.token_counts = self._executable(job)(
            logits, self.last_tokens, knobs, adjust, self.token_counts, bitmask, *((record,) if extend else ()))
        return results

    def _open_mask(self, rows: int):
        """A device bitmask of `rows` rows per group that allows every token (kept: built once per size)."""
        if rows not in self._open_masks:
            mask = np.full((self.dp * rows, bitmask_words(self.step.config.vocab_size)), -1, np.int32)
            self._open_masks[rows] = self._to_devices(mask) if self._mesh is not None else jnp.asarray(mask)
        return self._open_masks[rows]

    def _run(self, kind, n, batch, knobs, adjust=None, record=None, bitmask=None):
        """Send one step (forward, then sampler) to the device; returns its sampled tokens as a device array, not
        waited for (with `adjust`: the adjusting sampler's tokens and logprobs, drawn under `bitmask`)."""
        batch, knobs, adjust, record = self._to_devices((batch, knobs, adjust, record))
        logits, self.caches = self._executable((kind, n))(self.params, self.caches, self.last_tokens, batch)
        if adjust is not None:
            return self._sample_adjusted(kind, logits, knobs, adjust, record, bitmask)
        return self._sample(logits, knobs)

    def _run_extend_and_draft(self, n, batch, knobs, following):
        """A speculative engine's extend: forward with hidden states, sampler, then the MTP layer's pass and drafts."""
        batch, knobs, following = self._to_devices((batch, knobs, following))
        logits, hidden, self.caches = self._executable((EXTEND_HIDDEN, n))(self.params, self.caches, batch)
        tokens = self._sample(logits, knobs)
        self.drafts, self.caches = self._executable((DRAFT, n))(self.params, self.caches, hidden, batch, following,
                                                                tokens, self.drafts)
        return tokens

    def _run_verify(self, n, batch, knobs):
        batch, knobs = self._to_devices((batch, knobs))
        mode = "greedy" if knobs.greedy else "sample"
        result, self.last_tokens, self.drafts, self.caches = self._executable((StepKind.VERIFY, n, mode))(
            self.params, self.caches, self.last_tokens, self.drafts, batch, knobs)
        return result

    def _send(self, device_half, *args, **kwargs):
        """`device_half(*args, **kwargs)` (a step's transfers and executables): on the launch thread, as a future of
        its result, or here."""
        if self._launcher is None:
            return device_half(*args, **kwargs)
        return self._launcher.submit(device_half, *args, **kwargs)

    def block_until_ready(self) -> None:
        """Wait until every step sent so far has been launched (on the launch thread, if any) and has run."""
        if self._launcher is not None:
            self._launcher.submit(lambda: None).result()  # the thread runs its queue in order
        jax.block_until_ready(self.caches)

    @staticmethod
    def read(tokens) -> np.ndarray:
        """A step's sampled tokens on the host (waits for them, and for their launch on the launch thread); from
        every process's devices in a multi-process job."""
        if isinstance(tokens, concurrent.futures.Future):
            tokens = tokens.result()
        if all(array.is_fully_addressable for array in jax.tree.leaves(tokens)):
            return jax.tree.map(np.asarray, tokens)
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tokens, tiled=True))

    def launch(self, kind: StepKind, works: list, tables: list) -> tuple[object, int]:
        """Send one step of every dp group's work (works[g]: group g's chunks or requests, [] when idle; tables[g]
        its slot tables) -> (its results as a device array, not waited for, or with a launch thread a future of
        it; with rows per group: the sampled token of each chunk or request, or for VERIFY the k+1 tokens and the
        number of drafts accepted). Read them with `read`."""
        step = self.prepare(kind, works, tables)
        return self.send(step), step.rows

    def prepare(self, kind: StepKind, works: list, tables: list) -> PreparedStep:
        """A step's batches, built on this thread (see launch), ready to `send`."""
        if kind is StepKind.EXTEND:
            tokens = max(sum(chunk.length for chunk in chunks) for chunks in works)
            n = self.programs.bucket(StepKind.EXTEND, tokens)
            parts = [extend_batch(chunks, n, self.max_seqs, t, self.state_copies) for chunks, t in zip(works, tables)]
            if self.speculative:
                following = np.concatenate([next_tokens(chunks, n) for chunks in works])
                return PreparedStep(self._run_extend_and_draft, (n, *concat_groups(parts), following), self.max_seqs)
            adjusted = any(chunk.request.params.adjusted for chunks in works for chunk in chunks)
            if adjusted:
                parts = [(*part, *extend_adjust_knobs(chunks, self.max_seqs, t, self.record_size))
                         for part, chunks, t in zip(parts, works, tables)]
            return PreparedStep(self._run, (kind, n, *concat_groups(parts)), self.max_seqs, adjusted)
        n = self.programs.bucket(StepKind.DECODE, max(map(len, works)))
        if kind is StepKind.VERIFY:
            parts = [verify_batch(r, n, t) for r, t in zip(works, tables)]
            return PreparedStep(self._run_verify, (n, *concat_groups(parts)), n)
        parts = [decode_batch(r, n, t) for r, t in zip(works, tables)]
        adjusted = any(t.adjusted[part[0].slot_ids].any() for part, t in zip(parts, tables))
        if adjusted:
            parts = [(*part, adjust_knobs(t, part[0].slot_ids, part[0].slot_ids > 0)) for part, t in zip(parts, tables)]
        return PreparedStep(self._run, (kind, n, *concat_groups(parts)), n, adjusted)

    def send(self, step: PreparedStep, bitmask=None):
        """Send a prepared step -> its results, as `launch` returns them. `bitmask` (an adjusted step's only): the
        tokens each row may draw, int32[groups * rows, words] or a Future of it that the caller completes; with
        a launch thread the step's forward is launched before the mask is waited for, without one the Future must
        be done already (this thread launches)."""
        if bitmask is not None:
            if not step.adjusted:
                raise ValueError("a bitmask constrains the adjusting sampler's steps only")
            return self._send(step.run, *step.args, bitmask=bitmask)
        return self._send(step.run, *step.args)

    @property
    def launches_in_background(self) -> bool:
        """Whether steps are launched from a thread of their own (see the module docstring)."""
        return self._launcher is not None
