"""`python -m jaxmodels plan`: the mesh it reads from --dp / --tp, the collectives it reads from HLO text, and (in a
subprocess with 8 simulated CPU devices it arranges itself) the numbers of a planned tiny model against the same
model's engine built for real."""

import os
import subprocess
import sys

import pytest

from jaxmodels.plan import mesh_for
from jaxmodels.plan_collectives import H200_CLUSTER, collectives

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sglang_dp_attention_reads_as_dp_groups_of_one_device():
    assert mesh_for(8, 8, 8)[:2] == (8, 1)
    assert mesh_for(2, 8, 8)[:2] == (2, 4)
    assert mesh_for(16, 16, 16)[:2] == (16, 1)


def test_dp_times_tp_devices_read_as_our_mesh():
    assert mesh_for(2, 4, 8) == (2, 4, "ours")
    assert mesh_for(1, 8, 8) == (1, 8, "ours")
    assert mesh_for(2, 8, 16) == (2, 8, "ours")


def test_a_mesh_neither_reading_fits_is_refused():
    with pytest.raises(SystemExit, match="neither"):
        mesh_for(3, 8, 8)


def test_replica_groups_in_each_printed_form():
    """Explicit lists, iota with a transpose and mesh axes give the same groups of mesh positions."""
    forms = ["replica_groups={{0,2,4,6},{1,3,5,7}}", "replica_groups=[2,4]<=[4,2]T(1,0)",
             "replica_groups=mesh['x'=4,'y'=2] {'x'}"]
    for form in forms:
        (found,) = collectives(f"%a = bf16[16,64]{{1,0}} all-reduce(%p), channel_id=1, {form}, to_apply=%add", 8)
        assert found.groups == ((0, 2, 4, 6), (1, 3, 5, 7)), form


def test_ring_traffic_of_each_collective():
    """A result of 1 MB over 8 devices: the ring's bytes per device (plan_collectives' docstring)."""
    text = "\n".join(f"%c{i} = f32[262144]{{0}} {kind}(%p), replica_groups={{}}, dimensions={{0}}"
                     for i, kind in enumerate(["all-reduce", "all-gather", "reduce-scatter", "all-to-all"]))
    traffic = [c.traffic_bytes() for c in collectives(text, 8)]
    assert traffic == [2 * 7 / 8 * 2**20, 7 / 8 * 2**20, 7 * 2**20, 7 / 8 * 2**20]


def test_groups_spanning_two_hosts_take_the_network():
    (within, across) = collectives("%a = bf16[8]{0} all-gather(%p), replica_groups={{0,1,2,3,4,5,6,7}}\n"
                                   "%b = bf16[8]{0} all-gather(%p), replica_groups={{0,8}}", 16)
    assert H200_CLUSTER.link(within.groups) is H200_CLUSTER.nvlink
    assert H200_CLUSTER.link(across.groups) is H200_CLUSTER.network


@pytest.mark.slow  # a subprocess that compiles the tiny model's largest buckets and the real engine's decode step
def test_plan_equals_the_engine_built_for_real(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tests.jaxmodels.plan_check", str(tmp_path)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for line in ("the plan prints its table", "weights:", "caches:", "collectives: the"):
        assert line in result.stdout, result.stdout
