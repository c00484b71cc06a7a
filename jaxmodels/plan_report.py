"""The plan's tables (jaxmodels.plan): memory per device against the H200's, what fits otherwise, the decode step's
collectives and their estimated time; and the same as JSON."""

import json

from jaxmodels.plan_collectives import H200_CLUSTER, summary
from jaxmodels.plan_fit import largest_batch, largest_prefill_bucket, largest_seq_len
from jaxmodels.plan_mesh import H200_MEMORY, HBM_BANDWIDTH, job_name

GB = 1e9


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def mesh_label(plan) -> str:
    return f"dp={plan.dp} x tp={plan.tp}"


def verdict(plan) -> str:
    room = H200_MEMORY - plan.peak
    return f"fits, {room / GB:.1f} GB free" if room >= 0 else f"does not fit: {-room / GB:.1f} GB over"


def memory_rows(plans) -> list[list]:
    def prefill(p):
        return f"{p.temporaries(extend=True) / GB:.1f}" if any(q.is_extend for q in p.programs) else "not compiled"

    return [[mesh_label(p), p.read_as, p.devices, f"{p.weights / GB:.1f}", f"{p.caches / GB:.1f}",
             f"{p.state / GB:.2f}", f"{p.temporaries(extend=False) / GB:.1f}", prefill(p), f"{p.peak / GB:.1f}",
             verdict(p), f"{len(p.programs)}: {p.compile_wall_s:.0f} s"] for p in plans]


def what_fits(plan, max_position_embeddings: int) -> str:
    """Where the plan does not fit: the largest prefill bucket, if only the prefill programs' temporaries are too
    many; else the largest batch at its request length and the longest requests at its batch."""
    limits, label = plan.limits, mesh_label(plan)
    decode_peak = plan.resident + plan.temporaries(extend=False)
    if decode_peak <= H200_MEMORY:
        prefill = largest_prefill_bucket(plan, H200_MEMORY)
        where = (f"prefill buckets up to {prefill} tokens per dp group do (--max-prefill-tokens {prefill})" if prefill
                 else "with every bucket compiled (--buckets all) the plan says which prefill buckets do")
        return (f"{label}: the pools and the decode step fit ({(H200_MEMORY - decode_peak) / GB:.1f} GB free beside "
                f"the decode temporaries), the largest prefill bucket's {plan.temporaries(extend=True) / GB:.1f} GB of "
                f"temporaries do not; {where}")
    batch = largest_batch(plan, H200_MEMORY, limits["max_seq_len"])
    seq_len = largest_seq_len(plan, H200_MEMORY, limits["max_batch_size"], max_position_embeddings)
    parts = [f"max_batch_size {batch} at max_seq_len {limits['max_seq_len']}" if batch else None,
             f"max_seq_len {seq_len} at max_batch_size {limits['max_batch_size']}" if seq_len else None]
    parts = [p for p in parts if p]
    if not parts:
        return (f"{label}: the weights, state and temporaries alone take "
                f"{(plan.weights + plan.state + plan.temporaries()) / GB:.1f} GB of {H200_MEMORY / GB:.0f}: "
                "plan more devices")
    return f"{label} fits " + "; or ".join(parts)


def decode_rows(plans) -> list[list]:
    rows = []
    for p in plans:
        found = p.decode_collectives()
        rows.append([mesh_label(p), p.limits["max_batch_size"] // p.dp, len(found),
                     f"{sum(c.traffic_bytes() for c in found) / 1e6:.1f}", f"{p.communication_s() * 1e3:.2f}",
                     f"{p.communication_s(wide_as_16_bits=True) * 1e3:.2f}", f"{p.byte_floor_s * 1e3:.2f}"])
    return rows


def collective_rows(plan) -> list[list]:
    rows = []
    for row in summary(plan.decode_collectives()):
        c = row["collective"]
        link = "NVLink" if H200_CLUSTER.link(c.groups) is H200_CLUSTER.nvlink else "InfiniBand"
        rows.append([row["kind"], row["dtype"], f"{row['operand_bytes'] / 1e6:.3f}", f"{row['result_bytes'] / 1e6:.3f}",
                     row["groups"], row["count"], link, f"{row['count'] * c.seconds(H200_CLUSTER) * 1e3:.3f}"])
    return rows


def print_plans(plans, *, config, config_path: str, dtype: str, buckets: str) -> None:
    limits = plans[0].limits
    quantization = getattr(config, "quantization", None)
    weights = (f"FP8 ({'x'.join(map(str, quantization.block))} blocks)" if quantization and quantization.block
               else "FP8 (per tensor)" if quantization else dtype)
    print(f"\n## {config_path}: {type(config).__name__}, weights {weights}, activations {dtype}; "
          f"{limits['max_batch_size']} requests x {limits['max_seq_len']} tokens"
          + (f", {limits['num_speculative_tokens']} speculative tokens" if limits["num_speculative_tokens"] else "")
          + f"; {buckets} buckets compiled on {plans[0].platform}\n")
    print("Memory per device in GB (1e9 bytes), against an H200's 141 GB; temporaries: the most a decode or a "
          "prefill program holds beside its arguments; programs: how many, compiled (concurrently) in:\n")
    print(table(["mesh", "read as", "devices", "weights", "caches", "state", "decode temporaries",
                 "prefill temporaries", "peak", "H200", "programs"], memory_rows(plans)))
    print("\nLargest buffers of each mesh's most demanding program:\n")
    for p in plans:
        worst = p.worst_program
        print(f"- {mesh_label(p)}, {job_name(worst.job)}: {'; '.join(worst.largest_buffers)}")
    misfits = [p for p in plans if p.peak > H200_MEMORY]
    if misfits:
        print("\nWhat fits instead:\n")
        for p in misfits:
            print(f"- {what_fits(p, config.max_position_embeddings)}")
    print(f"\nDecode step of the largest bucket (rows per dp group): its collectives, the bytes each device sends, "
          f"their time on H200s (NVLink within 8, InfiniBand between hosts; as compiled, and with float32 ones at "
          f"16 bits as a GPU sends a bf16 model's), and the byte floor (weights + caches at "
          f"{HBM_BANDWIDTH / 1e12:.1f} TB/s):\n")
    print(table(["mesh", "rows per group", "collectives", "MB sent", "comm ms", "comm ms, f32 as 16 bits",
                 "byte floor ms"], decode_rows(plans)))
    for p in plans:
        print(f"\nCollectives of {mesh_label(p)}'s decode step ({', '.join(job_name(j) for j in p.decode_jobs)}); "
              f"groups as count x size [first group's devices]:\n")
        print(table(["collective", "dtype", "operand MB", "result MB", "groups", "count", "link", "ms"],
                    collective_rows(p)) if p.decode_collectives() else "(none)")


def plan_json(plan) -> dict:
    return dict(dp=plan.dp, tp=plan.tp, read_as=plan.read_as, devices=plan.devices, platform=plan.platform,
                limits=plan.limits, weights_bytes=plan.weights, cache_bytes=plan.caches,
                cache_bytes_by_pool=plan.cache_by_pool, state_bytes=plan.state,
                decode_temporary_bytes=plan.temporaries(extend=False),
                prefill_temporary_bytes=plan.temporaries(extend=True), peak_bytes=plan.peak,
                fits_h200=plan.peak <= H200_MEMORY, compile_wall_s=plan.compile_wall_s, compile_s=plan.compile_s,
                programs=[dict(job=job_name(p.job), lower_s=p.lower_s, compile_s=p.compile_s,
                               temp_bytes=p.temp_bytes, fresh_output_bytes=p.fresh_output_bytes,
                               collectives=len(p.collectives), largest_buffers=p.largest_buffers)
                          for p in plan.programs],
                decode_jobs=[job_name(j) for j in plan.decode_jobs],
                decode_collectives=[{k: v for k, v in row.items() if k != "collective"}
                                    for row in summary(plan.decode_collectives())],
                communication_s=plan.communication_s(),
                communication_16bit_s=plan.communication_s(wide_as_16_bits=True),
                byte_floor_s=plan.byte_floor_s)


def write_json(plans, path: str) -> None:
    with open(path, "w") as f:
        json.dump([plan_json(p) for p in plans], f, indent=1, default=str)
