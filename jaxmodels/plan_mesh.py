"""One mesh of a plan (jaxmodels.plan): the engine built on a model of abstract params, its step programs compiled
by its own warm-up, and what they hold per device.

The engine is the one `LLM` starts (`Engine` on a ("dp", "tp") mesh); on a model whose params are ShapeDtypeStructs
its runner lays params and pools out by the sharding rules without allocating them (engine.runner). Its table of
programs (engine.programs) lowers each from its abstract arguments; they are compiled here as warm-up compiles them
(lowered on one thread, compiled on a pool), each measured and then dropped.
"""

import concurrent.futures
import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodels.engine.cache import cache_arrays
from jaxmodels.engine.engine import Engine
from jaxmodels.families import abstract_model
from jaxmodels.plan_collectives import DTYPE_BYTES, H200_CLUSTER, collectives
from jaxmodels.step_context import StepKind
from sharding import make_mesh

H200_MEMORY = 141e9  # bytes of HBM3e per H200
HBM_BANDWIDTH = 4.8e12  # bytes/s per H200 (data sheet)


def shapes_only_model(config, dtype):
    """The model for `config` with abstract params (ShapeDtypeStructs): nothing allocated."""
    graphdef, state, _ = abstract_model(config, jnp.dtype(dtype))
    return nnx.merge(graphdef, state)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs laid out on a mesh (whole where none is given)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def cache_bytes_by_pool(caches) -> dict[str, int]:
    """A device's cache bytes by the pool axis their arrays grow with: {"page": ..., "slot": ...} (cache classes
    name it first in their AXES)."""
    by_pool = {"page": 0, "slot": 0}
    for cache, name, value in cache_arrays(caches):
        by_pool[type(cache).AXES[name][0]] += bytes_per_device(value)
    return by_pool


_ENTRY_ARRAY = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = ([a-z0-9]+)\[([\d,]*)\]\S* ([\w\-]+)\(")
# Results that are no buffer of their own: arguments, views of other buffers.
_NOT_TEMPORARY = {"parameter", "bitcast", "get-tuple-element", "constant", "tuple"}


def largest_buffers(hlo_text: str, count: int = 3) -> list[str]:
    """The `count` largest distinct array results of the entry computation, as "dtype[shape] (GB, op) x how many":
    where a program's temporaries go."""
    entry = hlo_text[hlo_text.find("\nENTRY "):]
    found = []
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        match = _ENTRY_ARRAY.match(line)
        if match and match.group(1) in DTYPE_BYTES and match.group(3) not in _NOT_TEMPORARY:
            dtype, dims, opcode = match.group(1), match.group(2), match.group(3)
            size = math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype]
            op = re.search(r'op_name="[^"]*?([\w\-]+)"', line)
            found.append((size, f"{dtype}[{dims}] ({size / 1e9:.1f} GB, {op.group(1) if op else opcode})"))
    counts: dict[str, tuple[int, int]] = {}  # the same buffer of every layer, once: text -> (size, how many)
    for size, text in found:
        counts[text] = (size, counts.get(text, (size, 0))[1] + 1)
    largest = sorted(counts.items(), key=lambda item: -item[1][0])[:count]
    return [text + (f" x {n}" if n > 1 else "") for text, (_, n) in largest]


@dataclasses.dataclass
class ProgramPlan:
    job: tuple
    lower_s: float
    compile_s: float
    temp_bytes: int  # memory_analysis: temporaries
    fresh_output_bytes: int  # outputs that are no donated (aliased) argument
    collectives: list
    largest_buffers: list

    @property
    def transient_bytes(self) -> int:
        """What the program holds besides its arguments while it runs."""
        return self.temp_bytes + self.fresh_output_bytes

    @property
    def is_extend(self) -> bool:
        """A prefill program (its bucket is a token count) rather than a decode one."""
        return getattr(self.job[0], "value", self.job[0]) in ("extend", "extend_hidden", "draft") or \
            "extend" in self.job[2:]


def job_name(job: tuple) -> str:
    return " ".join(str(getattr(part, "value", part)) for part in job)


def measured(job, lower_s: float, compile_s: float, executable, num_devices: int) -> ProgramPlan:
    memory = executable.memory_analysis()
    hlo = executable.as_text()
    return ProgramPlan(job=job, lower_s=lower_s, compile_s=compile_s, temp_bytes=memory.temp_size_in_bytes,
                       fresh_output_bytes=memory.output_size_in_bytes - memory.alias_size_in_bytes,
                       collectives=collectives(hlo, num_devices), largest_buffers=largest_buffers(hlo))


def decode_step_jobs(programs) -> list[tuple]:
    """The programs one greedy decode step of the largest bucket runs."""
    return [job for job in programs.bucket_jobs(StepKind.DECODE, programs.decode_sizes[-1]) if "sample" not in job]


@dataclasses.dataclass
class MeshPlan:
    dp: int
    tp: int
    read_as: str
    platform: str
    weights: int
    caches: int
    cache_by_pool: dict
    state: int
    programs: list
    decode_jobs: list
    limits: dict
    pool_sizes: object  # engine.cache.PoolSizes of one dp group
    compile_wall_s: float  # the engine's construction and warm-up (programs compile concurrently)

    @property
    def devices(self) -> int:
        return self.dp * self.tp

    @property
    def resident(self) -> int:
        """What a device holds between steps."""
        return self.weights + self.caches + self.state

    def temporaries(self, extend: bool | None = None) -> int:
        """The most any program (of prefill programs, or of decode ones) holds besides its arguments."""
        return max((p.transient_bytes for p in self.programs if extend is None or p.is_extend == extend), default=0)

    @property
    def peak(self) -> int:
        return self.resident + self.temporaries()

    @property
    def worst_program(self) -> ProgramPlan:
        return max(self.programs, key=lambda p: p.transient_bytes)

    @property
    def compile_s(self) -> float:
        """Lowering and compiling, summed over the programs."""
        return sum(p.lower_s + p.compile_s for p in self.programs)

    def decode_collectives(self) -> list:
        return [c for p in self.programs if p.job in self.decode_jobs for c in p.collectives]

    def communication_s(self, cluster=H200_CLUSTER, wide_as_16_bits: bool = False) -> float:
        """The decode step's collectives' time; `wide_as_16_bits` counts float32 ones at 2 bytes an element (what a
        GPU moves of a 16-bit model's, which a CPU compilation widens)."""
        return sum(c.seconds(cluster, 0.5 if wide_as_16_bits and c.dtype == "f32" else 1.0)
                   for c in self.decode_collectives())

    @property
    def byte_floor_s(self) -> float:
        return (self.weights + self.caches) / HBM_BANDWIDTH


def jobs_for(programs, buckets: str) -> list[tuple]:
    """The programs to compile: "all" that serving may call, "largest" those of the largest prefill and decode
    buckets (what warm-up compiles before serving), "decode" the largest decode bucket's step."""
    if buckets == "all":
        return programs.jobs()
    if buckets == "decode":
        return decode_step_jobs(programs)
    largest = [(kind, programs.sizes_of(kind)[-1]) for kind in (StepKind.EXTEND, StepKind.DECODE)]
    return list(dict.fromkeys(job for bucket in largest for job in programs.bucket_jobs(*bucket)))


def compile_each(programs, jobs: list[tuple], num_devices: int, threads: int, log) -> list[ProgramPlan]:
    """Lower each job (on this thread: tracing holds the GIL) and compile it on `threads` threads, as warm-up does,
    keeping of each executable only its measurements: a full-size model's executables take hundreds of MB each."""
    def compile_and_measure(job, lowered, lower_s):
        began = time.perf_counter()
        executable = lowered.compile()
        return measured(job, lower_s, time.perf_counter() - began, executable, num_devices)

    done, in_flight = [], set()

    def collect(return_when):
        nonlocal in_flight
        finished, in_flight = concurrent.futures.wait(in_flight, return_when=return_when)
        for future in finished:
            plan = future.result()
            done.append(plan)
            log(f"  [{len(done)}/{len(jobs)}] {job_name(plan.job)}: lowered in {plan.lower_s:.1f} s, compiled in "
                f"{plan.compile_s:.1f} s, temporaries {plan.transient_bytes / 1e9:.2f} GB, "
                f"{len(plan.collectives)} collectives")

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for job in jobs:
            began = time.perf_counter()
            lowered = programs.lower(job)
            in_flight.add(pool.submit(compile_and_measure, job, lowered, time.perf_counter() - began))
            del lowered
            if len(in_flight) >= threads:
                collect(concurrent.futures.FIRST_COMPLETED)
        collect(concurrent.futures.ALL_COMPLETED)
    return done


def plan_mesh(model, dp: int, tp: int, read_as: str, *, platform: str, buckets: str, limits: dict, threads: int,
              log=print) -> MeshPlan:
    """Build the engine for `model` (abstract params) on a dp x tp mesh and compile its programs (`buckets`: see
    jobs_for)."""
    began = time.perf_counter()
    mesh = make_mesh(dp, tp) if dp * tp > 1 else None
    engine = Engine(model, mesh=mesh, warmup="none", progress=False, launch_thread=False, **limits)
    runner, programs = engine.runner, engine.runner.programs
    jobs = jobs_for(programs, buckets)
    log(f"mesh dp={dp} x tp={tp} ({read_as}) on {dp * tp} {platform} devices: compiling {len(jobs)} programs "
        f"({buckets} buckets: prefill {programs.prefill_sizes}, decode {programs.decode_sizes} per dp group)")
    compiled = compile_each(programs, jobs, dp * tp, threads, log)
    plan = MeshPlan(dp=dp, tp=tp, read_as=read_as, platform=platform, weights=bytes_per_device(runner.params),
                    caches=bytes_per_device(runner.caches), cache_by_pool=cache_bytes_by_pool(runner.caches),
                    state=bytes_per_device((runner.last_tokens, runner.drafts, runner.token_counts)),
                    programs=compiled, decode_jobs=decode_step_jobs(programs), limits=limits,
                    pool_sizes=engine.sizes, compile_wall_s=time.perf_counter() - began)
    del engine, runner, programs
    jax.clear_caches()
    return plan
