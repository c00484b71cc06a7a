"""Device meshes with the axes ("dp", "tp")."""

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
