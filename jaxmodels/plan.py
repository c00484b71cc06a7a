"""`python -m jaxmodels plan`: whether a model fits a mesh of H200s, and what its decode step moves between them, from
the step programs the engine would compile for that mesh, compiled from abstract shapes (no weight allocated).

The engine is built as `LLM` builds it, on a model whose params are ShapeDtypeStructs (`nnx.eval_shape`): its runner
lays params and cache pools out by the sharding rules, with the pool sizes it would use, allocating nothing, and its
table of programs lowers every program serving may call (each prefill and decode bucket, the samplers, the
speculative programs with --num-speculative-tokens), compiled as its warm-up compiles them (jaxmodels.plan_mesh). On
CPU the devices are simulated (--xla_force_host_platform_device_count, arranged before jax starts); where enough GPUs
are present they are used.

Per device (every device holds the same: the rules split an array only where the mesh divides it):
  * weights: the device's shards of the params;
  * caches: its shards of the pools for max_batch_size requests of max_seq_len tokens (KV / MLA latent / index-key
    pages, Mamba state slots and prefix caching's state snapshots, null page and slot included);
  * state: the engine's other per-slot arrays (last tokens, drafts, penalized token counts);
  * temporaries: the most any step program holds besides its arguments: `memory_analysis()`'s temp bytes plus its
    outputs that are no donated buffer (the logits), the most over the prefill and over the decode programs;
  peak = weights + caches + state + temporaries, against an H200's 141 GB (141e9 bytes). Where the peak does not fit:
  the largest max_batch_size at the given max_seq_len and the largest max_seq_len at the given max_batch_size whose
  pools fit beside the rest (pools grow linearly in pages and state slots, jaxmodels.plan_fit), and with every bucket
  compiled the largest prefill bucket whose temporaries fit.

The decode step (the largest decode bucket: max_batch_size / dp rows per dp group):
  * communication: the collectives of its programs (the forward and its greedy sampler; with speculation the greedy
    verify program), read from their compiled HLO and priced per device with the ring algorithm (R: a collective's
    result bytes on a device, n: its group's size; all-reduce 2(n-1)/n·R, all-gather (n-1)/n·R, reduce-scatter
    (n-1)·R, all-to-all (n-1)/n·R, collective-permute R), each over its group's slowest link (NVLink 4 at 450 GB/s
    per direction within a host of 8 H200s, 400 Gb/s InfiniBand per GPU between hosts) plus a latency of 10 us
    (20 us between hosts): time = Σ (latency + traffic / bandwidth), nothing overlapped (jaxmodels.plan_collectives);
  * byte floor: (weights + caches) per device / 4.8 TB/s (H200 HBM3e), every weight and every cache page read once.
    An upper bound of the bytes: a DSA step reads only the top-k latent rows, and few requests are at max_seq_len.
  The step takes at least the floor, plus whatever communication does not overlap it.

Compiled on CPU, the programs are XLA's CPU compilation of the same step, in which the Pallas kernels run their XLA
references: temporaries are then an upper bound of a GPU's (the table names the largest buffers; a grouped matmul's
reference, for one, becomes a dense product over every expert), and 16-bit collectives travel as float32, twice a
GPU's bytes (the table gives the time both ways). The CPU's default schedule runs independent ops concurrently and
keeps far more buffers alive (every layer's dequantized FP8 weights at once: 400 GB a device for DeepSeek-V3.2); the
plan asks XLA for its memory-minimizing schedule, the kind a GPU compilation uses.
"""

import argparse
import glob
import logging
import os
import sys
import time

# XLA flags for compiling on simulated CPU devices: the memory-minimizing schedule (module docstring), and LLVM's
# fastest code generation (the code never runs; buffers are assigned before it).
CPU_PLAN_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false", "--xla_backend_optimization_level=0")
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

MESH_HELP = """\
Meshes. The engine's mesh has the axes ("dp", "tp") over dp x tp devices: attention (and Mamba) data-parallel over dp
groups, each group's heads split over its tp devices; MLP / MoE weights split over all devices. SGLang's
`--tp T --dp D --enable-dp-attention` runs T GPUs in D attention groups of T/D GPUs with the MoE over all T: that is
our dp=D, tp=T/D. So --dp D --tp T on --devices N reads as ours when D*T == N, and as SGLang's when T == N (D dividing
it): `--dp 8 --tp 8` on 8 devices is SGLang's recommendation, our dp=8 x tp=1. The mesh used is printed."""


def parse_args(argv, prog=None):
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog=MESH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="an HF config.json (full-size ones: bench/configs/)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel attention groups (see Meshes below)")
    parser.add_argument("--tp", type=int, default=None, help="tensor parallelism (see Meshes below)")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices of the mesh (default: 8, an H200 host; with --meshes their largest)")
    parser.add_argument("--meshes", default=None,
                        help="several meshes in our notation, DPxTP comma-separated (e.g. 8x1,2x4,1x8), one after "
                             "the other in this process")
    parser.add_argument("--max-batch-size", type=int, default=256, help="requests served at once, all dp groups")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + output tokens per request")
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="tokens per prefill step and dp group")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["dequantize", "fp8-block"], default=None,
                        help="the checkpoint's quantization_config by default; dequantize: weights in --dtype; "
                             "fp8-block: DeepSeek-V3.2's block FP8 format")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="plan MTP speculative decoding with this many drafts (keeps the MTP layers)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="no Mamba state snapshots for prefix caching (hybrid models)")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--decode-sizes", default=None,
                        help="decode buckets per dp group, comma-separated (default: the engine's)")
    parser.add_argument("--prefill-sizes", default=None,
                        help="prefill buckets (tokens per dp group), comma-separated (default: the engine's)")
    parser.add_argument("--buckets", choices=["all", "largest", "decode"], default="all",
                        help="all: compile every program serving may call; largest: the largest prefill and decode "
                             "buckets' (with their greedy samplers), which bound the temporaries and hold the decode "
                             "step; decode: the largest decode bucket's step only (its collectives: e.g. at 256 rows "
                             "per dp group with --max-batch-size 256*dp). A full-size model takes minutes a program "
                             "on a CPU")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="programs compiled at once (default: one per core, as warm-up does; each of a full-size "
                             "model takes a few GB of host memory while it compiles)")
    parser.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                        help="auto: the GPUs if there are enough, else simulated CPU devices")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the plan as JSON here")
    args = parser.parse_args(argv)
    if args.meshes is None and (args.dp is None or args.tp is None):
        parser.error("give --dp and --tp, or --meshes")
    return args


def mesh_for(dp: int, tp: int, devices: int) -> tuple[int, int, str]:
    """(dp, tp, how it was read) of the engine's mesh for --dp / --tp on `devices` devices (MESH_HELP)."""
    if dp * tp == devices:
        return dp, tp, "ours"
    if tp == devices and tp % dp == 0:
        return dp, tp // dp, f"SGLang's --tp {tp} --dp {dp}"
    raise SystemExit(f"--dp {dp} --tp {tp} fits {devices} devices neither as our mesh (dp*tp devices) nor as "
                     f"SGLang's (tp devices in dp attention groups); see --help")


def meshes_of(args) -> tuple[list[tuple[int, int, str]], int]:
    """The meshes to plan and the devices they need."""
    if args.meshes:
        meshes = [(*(int(x) for x in item.lower().split("x")), "ours") for item in args.meshes.split(",")]
        return meshes, args.devices or max(dp * tp for dp, tp, _ in meshes)
    devices = args.devices or 8
    return [mesh_for(args.dp, args.tp, devices)], devices


def arrange_devices(count: int, platform: str, argv: list[str]) -> str:
    """Make `count` devices of `platform` ("auto": GPUs if this host has that many, else CPU) what jax starts with,
    before it starts its backends; if they started already (a program that used jax first), run this command again
    in a new interpreter with that environment. Returns the platform."""
    import jax
    from jax._src import xla_bridge

    if platform == "auto":
        platform = "gpu" if len(glob.glob("/dev/nvidia[0-9]*")) >= count else "cpu"
    if platform == "gpu":
        return platform
    ours = {flag.split("=")[0] for flag in (DEVICE_COUNT_FLAG, *CPU_PLAN_FLAGS)}
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.split("=")[0] not in ours]
    environment = dict(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([*kept, f"{DEVICE_COUNT_FLAG}={count}",
                                                                 *CPU_PLAN_FLAGS]))
    if not xla_bridge.backends_are_initialized():
        os.environ.update(environment)
        # jax read JAX_PLATFORMS when it was imported (above): without this a GPU host short of `count` GPUs would
        # start its GPU backend anyway and plan on it (XLA_FLAGS is read when the backends start)
        jax.config.update("jax_platforms", environment["JAX_PLATFORMS"])
        return platform
    if jax.default_backend() == "cpu" and jax.device_count() >= count:
        return platform
    os.execve(sys.executable, [sys.executable, "-m", "jaxmodels", "plan", *argv], {**os.environ, **environment})


def planned_config(path: str, *, quantization: str | None, speculative: bool):
    """The typed config of the model the engine would serve: without MTP layers unless it drafts with them (as LLM
    loads it), with the asked quantization."""
    from jaxmodels.benchmark import FP8_BLOCK_QUANTIZATION, cut_layers
    from jaxmodels.configs import read_config_dict
    from jaxmodels.families import load_config
    from jaxmodels.loading import without_mtp

    raw = cut_layers(read_config_dict(path), None)
    if quantization == "dequantize":
        raw.pop("quantization_config", None)
    elif quantization == "fp8-block":
        raw["quantization_config"] = FP8_BLOCK_QUANTIZATION
    config = load_config(raw)
    return config if speculative else without_mtp(config)


def engine_limits(args) -> dict:
    """The Engine's keyword arguments for the limits asked."""
    def sizes(text):
        return [int(x) for x in text.split(",")] if text else None

    return dict(max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
                max_prefill_tokens=args.max_prefill_tokens, num_speculative_tokens=args.num_speculative_tokens,
                enable_prefix_caching=not args.no_prefix_caching, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                decode_sizes=sizes(args.decode_sizes), prefill_sizes=sizes(args.prefill_sizes))


def main(argv=None, prog: str | None = None) -> list:
    """Plan each mesh asked, print the tables; returns the plans (jaxmodels.plan_mesh.MeshPlan)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    meshes, devices = meshes_of(args)
    platform = arrange_devices(devices, args.platform, argv)
    from jaxmodels.plan_mesh import plan_mesh, shapes_only_model
    from jaxmodels.plan_report import print_plans, write_json

    logging.getLogger("jaxmodels").setLevel(logging.WARNING)  # the engine's limits and pools: the tables say them

    def log(line):
        print(line, file=sys.stderr, flush=True)

    config = planned_config(args.config, quantization=args.quantization, speculative=args.num_speculative_tokens > 0)
    began = time.perf_counter()
    model = shapes_only_model(config, args.dtype)
    log(f"{args.config}: abstract model built in {time.perf_counter() - began:.1f} s")
    plans = [plan_mesh(model, dp, tp, read_as, platform=platform, buckets=args.buckets, limits=engine_limits(args),
                       threads=args.threads, log=log) for dp, tp, read_as in meshes]
    print_plans(plans, config=config, config_path=args.config, dtype=args.dtype, buckets=args.buckets)
    if args.json:
        write_json(plans, args.json)
    return plans
