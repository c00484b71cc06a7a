"""Partition rules for params, by dotted param path.

Under `jax.jit` any sharding computes the same function (XLA inserts the collectives), so these rules are layout
choices for speed and memory, never for correctness:
- attention projections split by heads over `tp` (columns of q/k/v, rows of o);
- Mamba mixers stay whole on every device of a `dp` group: their in_proj packs z|x|B|C|dt, which a column split
  would cut across, and their state is per request, so Mamba scales by splitting the batch over `dp`;
- dense MLPs split their hidden dimension over both axes; routed experts are split by expert over both axes
  (expert parallelism), falling back to the intermediate dimension when the expert count does not divide;
- embeddings and the LM head split the vocabulary over `tp`; norms and routers are replicated.
A dimension that the chosen axes do not divide is left whole rather than padded.
"""

import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

ALL = ("dp", "tp")

# (regex over the dotted path, spec per dimension); first match wins.
RULES = (
    (r"\.mixer\.(q_proj|k_proj|v_proj)\.kernel$", (None, "tp")),
    (r"\.mixer\.o_proj\.kernel$", ("tp", None)),
    (r"\.mixer\.experts\.(gate_proj|up_proj|down_proj)$", (ALL, None, None)),
    (r"\.(mixer|shared_experts)\.(gate_proj|up_proj)\.kernel$", (None, ALL)),
    (r"\.(mixer|shared_experts)\.down_proj\.kernel$", (ALL, None)),
    (r"^embeddings\.embedding$", ("tp", None)),
    (r"^lm_head\.kernel$", (None, "tp")),
)
# When experts do not divide over all devices, split each expert's intermediate dimension instead.
EXPERT_FALLBACK = {"gate_proj": (None, None, ALL), "up_proj": (None, None, ALL), "down_proj": (None, ALL, None)}


def _axis_size(mesh, axes) -> int:
    if axes is None:
        return 1
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size


def _fits(mesh, spec, shape) -> bool:
    return len(spec) == len(shape) and all(dim % _axis_size(mesh, axes) == 0 for axes, dim in zip(spec, shape))


def spec_for(path: str, shape: tuple[int, ...], mesh) -> P:
    for pattern, spec in RULES:
        match = re.search(pattern, path)
        if not match:
            continue
        if _fits(mesh, spec, shape):
            return P(*spec)
        if "experts" in pattern:
            fallback = EXPERT_FALLBACK[match.group(1)]
            if _fits(mesh, fallback, shape):
                return P(*fallback)
        # Drop only the axes that do not divide, keep the rest.
        return P(*(axes if dim % _axis_size(mesh, axes) == 0 else None for axes, dim in zip(spec, shape)))
    return P()


def param_partition_specs(params: dict, mesh) -> dict:
    """{dotted path: PartitionSpec} for a {dotted path: array or ShapeDtypeStruct} dict."""
    return {path: spec_for(path, tuple(value.shape), mesh) for path, value in params.items()}


def shard_params(params: dict, mesh) -> dict:
    """`params` placed on `mesh` by the rules."""
    specs = param_partition_specs(params, mesh)
    return {path: jax.device_put(value, NamedSharding(mesh, specs[path])) for path, value in params.items()}
