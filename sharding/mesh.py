"""Device meshes with the axes ("dp", "tp"), over one process's devices or, after `initialize_distributed`, over
every process's (multi-host)."""

import os

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(dp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A ("dp", "tp") mesh over the first dp*tp devices (all of `devices` if given)."""
    if dp < 1 or tp < 1:
        raise ValueError(f"dp and tp must be >= 1, got dp={dp}, tp={tp}")
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ValueError(f"dp*tp = {dp * tp} devices requested, only {len(devices)} available "
                         f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N")
    return Mesh(np.array(devices[: dp * tp]).reshape(dp, tp), ("dp", "tp"))


def initialize_distributed() -> bool:
    """Join a multi-process JAX job when the environment describes one, so that `jax.devices()` (and the meshes
    made from it) span every host. Call it first thing, before anything touches a device.

    The environment: JAX_COORDINATOR_ADDRESS (host:port of process 0), plus JAX_NUM_PROCESSES and JAX_PROCESS_ID
    unless jax detects the cluster itself (SLURM, Open MPI, ...). Every process then runs the same program on the
    same requests (the engine's scheduling is deterministic), or process 0 takes the requests and the others repeat
    its engine's calls (LLM.lead / LLM.follow, `serve`; docs/multihost.md); each feeds and reads its own devices'
    shards. Returns whether a job was joined.
    """
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    options = {}
    if "JAX_NUM_PROCESSES" in os.environ:
        options["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in os.environ:
        options["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(address, **options)
    return True
