"""The step programs of a runner by job, and which of them are compiled: what warm-up works on.

A job is (program, bucket) or (program, rows, sampler mode); a bucket (EXTEND token count or DECODE batch size) is
usable once every program it calls is compiled (`bucket_jobs`, `mark_ready`). The table holds the jitted programs
and abstract arguments (shapes, dtypes, shardings) to lower them with, never the runner's arrays: compiling in the
background reads nothing that steps donate, and keeps no weights or caches alive once the engine is dropped.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.engine.batch import adjust_knobs, decode_batch, extend_adjust_knobs, extend_batch, verify_batch
from jaxmodels.engine.buckets import bucket_for
from jaxmodels.engine.grammar import bitmask_words
from jaxmodels.engine.scheduler import SlotTables
from jaxmodels.step_context import StepKind

SAMPLERS = ("greedy", "sample")
# The samplers of steps with requests that adjust their logits or ask for logprobs (engine.sampler.sample_adjusted).
ADJUSTED_GREEDY = "adjusted_greedy"
ADJUSTED = (ADJUSTED_GREEDY, "adjusted_sample")
# Samplers compiled when the first request that needs them comes (engine.warmup.Warmup.compile_on_demand), not
# with the buckets, each kind for every bucket at once as one pseudo-bucket: the sampling sampler (temperature > 0,
# a sort of the vocabulary) and the adjusting ones. Many engines never run them, and on a CPU they are more than
# half of a bucket's compile time. A speculative engine's verify programs sample inside; its samplers are bucket
# programs.
SAMPLING, ADJUSTING = "sampling", "adjusting"
ON_DEMAND = (SAMPLING, ADJUSTING)
# What each kind serves, in the words of the progress bar and the log.
ON_DEMAND_USES = {SAMPLING: "temperature > 0",
                  ADJUSTING: "adjusted logits and logprobs"}  # penalties, bias, min_tokens, grammars
# Programs of a speculative engine besides the samplers (see engine.runner).
EXTEND_HIDDEN, DRAFT = "extend_hidden", "draft"


def abstract(array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)


def concat_groups(parts: list):
    """[(batch, knobs, ...)] of each group -> one tuple with the groups' rows back to back."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *arrays: np.concatenate(arrays), *parts)


class StepPrograms:
    def __init__(self, programs: dict, arrays: dict, *, decode_sizes, prefill_sizes, max_seqs: int, dp: int,
                 speculative: int, pages_per_seq: int, vocab_size: int, hidden_size: int, dtype,
                 state_copies: int = 0, record_size: int = 0):
        """`programs`: the runner's jitted programs by name (see jobs); `arrays`: its params, caches, last_tokens and
        drafts, of which only the shapes, dtypes and shardings are kept."""
        self.programs = programs
        self.abstract = jax.tree.map(abstract, arrays)
        self.decode_sizes, self.prefill_sizes = decode_sizes, prefill_sizes
        self.max_seqs, self.dp, self.speculative = max_seqs, dp, speculative
        self.state_copies, self.record_size = state_copies, record_size
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, hidden_size, dtype
        self.example_tables = SlotTables(1, pages_per_seq)
        self._compiled: dict[tuple, object] = {}
        # The buckets steps may use: those whose programs are all compiled (engine.warmup compiles them, the
        # largest first; the step path never compiles, unless lazily).
        self._ready = {StepKind.EXTEND: [], StepKind.DECODE: []}
        # ON_DEMAND kinds compiled (a speculative engine's sampling one is among its buckets).
        self.on_demand_ready = {SAMPLING: bool(speculative), ADJUSTING: False}
        self._lazy = False

    def sizes_of(self, kind: StepKind) -> list[int]:
        """The bucket sizes of `kind`: EXTEND token counts or DECODE batch sizes (a speculative engine's VERIFY
        steps take the decode sizes)."""
        return self.prefill_sizes if kind is StepKind.EXTEND else self.decode_sizes

    def bucket_jobs(self, kind: StepKind, n: int) -> list[tuple]:
        """The executables a step of `kind` (EXTEND, or DECODE for decode and verify steps) in bucket n calls."""
        if kind == SAMPLING:
            return [("sampler", size, "sample") for size in [self.max_seqs, *self.decode_sizes]]
        if kind == ADJUSTING:
            return ([("sampler", self.max_seqs, "extend", mode) for mode in ADJUSTED]
                    + [("sampler", size, mode) for size in self.decode_sizes for mode in ADJUSTED])
        if kind is StepKind.EXTEND:
            if self.speculative:
                return [(EXTEND_HIDDEN, n), (DRAFT, n)] + [("sampler", self.max_seqs, mode) for mode in SAMPLERS]
            return [(StepKind.EXTEND, n), ("sampler", self.max_seqs, "greedy")]
        if self.speculative:
            return [(StepKind.VERIFY, n, mode) for mode in SAMPLERS]
        return [(StepKind.DECODE, n), ("sampler", n, "greedy")]

    def jobs(self) -> list[tuple]:
        """Every executable serving may call (the ON_DEMAND samplers included)."""
        buckets = [(kind, n) for kind in (StepKind.EXTEND, StepKind.DECODE) for n in self.sizes_of(kind)]
        return list(dict.fromkeys(job for bucket in buckets + [(kind, 0) for kind in ON_DEMAND]
                                  for job in self.bucket_jobs(*bucket)))

    @staticmethod
    def samplers_for(params) -> str | None:
        """The ON_DEMAND kind a request with SamplingParams `params` needs, or None."""
        return ADJUSTING if params.adjusted else SAMPLING if params.temperature > 0 else None

    def example(self, kind, n):
        """An all-padding (batch, sampling knobs) of bucket n for every group: the exact shapes and dtypes of a real
        one."""
        if kind == StepKind.EXTEND:
            part = extend_batch([], n, self.max_seqs, self.example_tables, self.state_copies)
        elif kind == StepKind.VERIFY:
            part = verify_batch([], n, self.example_tables)
        else:
            part = decode_batch([], n, self.example_tables)
        return concat_groups([part] * self.dp)

    def _example_adjust(self, rows: int, extend: bool) -> tuple:
        """All-padding AdjustKnobs of `rows` rows (and an extend step's TokenRecord) for every group."""
        tables = self.example_tables
        if extend:
            return concat_groups([extend_adjust_knobs([], rows, tables, self.record_size)] * self.dp)
        return concat_groups([(adjust_knobs(tables, np.zeros(rows, np.int32), np.zeros(rows, bool)),)] * self.dp)

    def program_and_args(self, job) -> tuple:
        """(the jitted program of `job`, abstract arguments of its exact shapes, dtypes and shardings)."""
        program, n, *mode = job
        abstract = self.abstract
        if program == "sampler":
            logits = jax.ShapeDtypeStruct((self.dp * n, self.vocab_size), jnp.float32)
            _, knobs = self.example(StepKind.DECODE, n)
            if mode[0] in SAMPLERS:
                return self.programs[mode[0]], (logits, abstract["last_tokens"], knobs)
            part = self._example_adjust(n, extend=mode[0] == "extend")
            bitmask = jax.ShapeDtypeStruct((self.dp * n, bitmask_words(self.vocab_size)), jnp.int32)
            return self.programs[tuple(mode) if len(mode) > 1 else mode[0]], (
                logits, abstract["last_tokens"], knobs, part[0], abstract["token_counts"], bitmask, *part[1:])
        model_args = (abstract["params"], abstract["caches"])
        if program == EXTEND_HIDDEN:
            return self.programs[program], (*model_args, self.example(StepKind.EXTEND, n)[0])
        if program == DRAFT:
            batch, _ = self.example(StepKind.EXTEND, n)
            hidden = jax.ShapeDtypeStruct((self.dp * n, self.hidden_size), self.dtype)
            tokens = jax.ShapeDtypeStruct((self.dp * n,), jnp.int32)
            sampled = jax.ShapeDtypeStruct((self.dp * self.max_seqs,), jnp.int32)
            return self.programs[program], (*model_args, hidden, batch, tokens, sampled, abstract["drafts"])
        if program == StepKind.VERIFY:
            return self.programs[program, mode[0]], (*model_args, abstract["last_tokens"], abstract["drafts"],
                                                     *self.example(program, n))
        return self.programs[program], (*model_args, abstract["last_tokens"], self.example(program, n)[0])

    def lower(self, job):
        """`job`'s program lowered for its exact argument shapes (reads no array)."""
        program, args = self.program_and_args(job)
        return program.lower(*args)

    def is_compiled(self, job) -> bool:
        return job in self._compiled

    def store_compiled(self, job, executable) -> None:
        self._compiled[job] = executable

    def mark_ready(self, kind: StepKind, n: int) -> None:
        """Let steps of `kind` use bucket n from now on (every program of bucket_jobs(kind, n) is compiled). The
        list is replaced, not changed in place: the scheduling thread may be reading the old one."""
        if kind in ON_DEMAND:
            self.on_demand_ready[kind] = True
            return
        self._ready[kind] = sorted({*self._ready[kind], n})

    def ready_buckets(self) -> dict:
        """{EXTEND: token counts, DECODE: batch sizes} that steps may use now."""
        return dict(self._ready)

    def bucket(self, kind: StepKind, n: int) -> int:
        """The smallest ready bucket of `kind` (EXTEND or DECODE) holding n tokens or rows."""
        return bucket_for(self._ready[kind], n)

    def compile_lazily(self) -> None:
        """Every bucket usable at once, each program compiled on its first call (on the step path)."""
        self._lazy = True
        self._ready = {kind: list(self.sizes_of(kind)) for kind in self._ready}
        self.on_demand_ready = dict.fromkeys(ON_DEMAND, True)

    def executable(self, job):
        if self._lazy and job not in self._compiled:  # warm-up mode "none" only: compiles on the step path
            self._compiled[job] = self.lower(job).compile()
        return self._compiled[job]
