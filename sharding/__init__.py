"""Meshes and partition rules: attention and Mamba data-parallel over `dp` (heads over `tp`), MLP/MoE over all."""

from sharding.mesh import make_mesh
from sharding.rules import cache_partition_specs, param_partition_specs, shard_params

__all__ = ["make_mesh", "cache_partition_specs", "param_partition_specs", "shard_params"]
