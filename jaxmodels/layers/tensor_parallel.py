"""Custom-call kernels under tensor parallelism: each device runs the kernel on its own heads or experts.

The engine's step is a shard_map manual over "dp" that leaves "tp" to the compiler (see jaxmodels.engine.runner).
XLA partitions its own ops over "tp", but not a custom call, which our Pallas kernels are: it gathers every operand
whole onto each device and runs the call there. For a grouped matmul over experts split over "tp" that gathers the
experts' weights at every MoE layer of every step; for paged attention, the KV pages of every layer. Layers that call
such a kernel on arrays split over "tp" run that part manual over "tp" instead (`manual_over_tp`), with the specs
the engine recorded on their params (`tp_spec`) or, for caches, from the layer's own head counts.
"""

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmodels.nnx_params import merge_params, param_path

TP = "tp"


def compiler_tp_size() -> int:
    """Devices on the "tp" axis that the compiler splits arrays over in the current trace: 1 outside a mesh, on a
    mesh without "tp", or where the code is manual over "tp" already."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP not in mesh.axis_names or TP in mesh.manual_axes:
        return 1
    return mesh.shape[TP]


def tp_spec(variable: nnx.Variable) -> P:
    """A param's layout inside a shard_map manual over "tp": "tp" on the dimensions the engine split over it (see
    ModelStep.record_tp_specs), replicated for a param it did not record."""
    return variable.get_metadata().get("tp_spec") or P()


def manual_over_tp(fn, in_specs, out_specs):
    """fn as a shard_map manual over "tp" on the current mesh (the other axes stay as they are)."""
    return jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs, axis_names={TP}, check_vma=False)


def module_over_tp(module: nnx.Module):
    """(arrays, specs, rebuild): a module's param arrays, their `tp_spec`s, and `rebuild(arrays)` -> the module with
    those arrays in place, for passing a module through `manual_over_tp` (whose arguments must be arrays)."""
    graphdef, state = nnx.split(module)
    flat = nnx.to_flat_state(state)
    paths = [param_path(key) for key, _ in flat]
    arrays = [variable.get_value() for _, variable in flat]
    specs = [tp_spec(variable) for _, variable in flat]

    def rebuild(local_arrays):
        return merge_params(graphdef, state, dict(zip(paths, local_arrays)))

    return arrays, specs, rebuild
