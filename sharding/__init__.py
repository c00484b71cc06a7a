"""Meshes and partition rules: params and caches declare logical axes where they are defined, sharding.rules maps
them to mesh axes (attention and Mamba data-parallel over `dp`, heads over `tp`, MLP/MoE over all)."""

from sharding.mesh import initialize_distributed, make_mesh
from sharding.rules import cache_partition_specs, manual_part, param_partition_specs, shard_params, spec_for

__all__ = ["initialize_distributed", "make_mesh", "cache_partition_specs", "manual_part", "param_partition_specs",
           "shard_params", "spec_for"]
