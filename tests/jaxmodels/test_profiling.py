"""jaxmodels.profiling on a hand-written trace: per-op totals, kernels per step, and the device's busy time."""

import gzip
import json

from jaxmodels.profiling import HOST, device_occupancy, format_occupancy, format_op_table, op_table


def write_trace(directory, events):
    run = directory / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
            dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU"))]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump(dict(traceEvents=meta + events), f)


def kernel(name, ts, dur, pid=1, tid=1):
    return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid)


def test_busy_time_is_the_union_of_kernel_intervals(tmp_path):
    # Two steps of [0, 10) and [12, 20), a second stream overlapping the first step, a host event ignored.
    write_trace(tmp_path, [kernel("gemm_a", 0, 6), kernel("fusion_b", 5, 5), kernel("copy_c", 2, 3, tid=2),
                           kernel("gemm_a", 12, 8), kernel("launch", 0, 30, pid=2)])
    busy, span = device_occupancy(str(tmp_path))
    assert (busy, span) == (18.0, 20.0)
    assert format_occupancy(busy, span, steps=2).endswith("idle 10.0%")
    ops = op_table(str(tmp_path))
    assert [(op.name, op.total_us, op.count) for op in ops] == [("gemm_a", 14.0, 2), ("fusion_b", 5.0, 1),
                                                               ("copy_c", 3.0, 1)]
    assert "2 kernels per step" in format_op_table(ops, steps=2)
    assert [op.name for op in op_table(str(tmp_path), HOST)] == ["launch"]


def test_an_empty_device_is_neither_busy_nor_idle(tmp_path):
    write_trace(tmp_path, [kernel("launch", 0, 30, pid=2)])
    assert device_occupancy(str(tmp_path)) == (0.0, 0.0)
    assert format_occupancy(0.0, 0.0).endswith("idle 0.0%")
