"""Partition rules for params, by dotted param path.

Under `jax.jit` any sharding computes the same function (XLA inserts the collectives), so these rules are layout
choices for speed and memory, never for correctness:
- GQA attention projections split by heads over `tp` (columns of q/k/v, rows of o); MLA stays whole for now (its
  latent cache is shared by all heads, so a head split would still need every latent row on every device);
- Mamba mixers stay whole on every device of a `dp` group: their in_proj packs z|x|B|C|dt, which a column split
  would cut across, and their state is per request, so Mamba scales by splitting the batch over `dp`;
- dense MLPs split their hidden dimension over both axes; routed experts are split by expert over both axes
  (expert parallelism), falling back to the intermediate dimension when the expert count does not divide;
- embeddings and the LM head split the vocabulary over `tp`; norms and routers are replicated.
A dimension that the chosen axes do not divide is left whole rather than padded.
"""

import dataclasses
import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

ALL = ("dp", "tp")

# (regex over the dotted path, spec per dimension); first match wins.
RULES = (
    (r"\.mixer\.(q_proj|k_proj|v_proj)\.kernel$", (None, "tp")),
    (r"\.mixer\.o_proj\.kernel$", ("tp", None)),
    (EXPERTS := r"\.(?:mixer|mlp)\.experts\.(gate_proj|up_proj|down_proj)$", (ALL, None, None)),
    (r"\.(mixer|mlp|shared_experts)\.(gate_proj|up_proj)\.kernel$", (None, ALL)),
    (r"\.(mixer|mlp|shared_experts)\.down_proj\.kernel$", (ALL, None)),
    (r"^(embeddings|embed_tokens)\.embedding$", ("tp", None)),
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


def _fit(spec, shape, mesh) -> P:
    """`spec` with the axes that do not divide their dimension dropped."""
    return P(*(axes if dim % _axis_size(mesh, axes) == 0 else None for axes, dim in zip(spec, shape)))


def spec_for(path: str, shape: tuple[int, ...], mesh) -> P:
    for pattern, spec in RULES:
        match = re.search(pattern, path)
        if not match:
            continue
        if _fits(mesh, spec, shape):
            return P(*spec)
        if pattern == EXPERTS:
            fallback = EXPERT_FALLBACK[match.group(1)]
            if _fits(mesh, fallback, shape):
                return P(*fallback)
        return _fit(spec, shape, mesh)
    return P()


# Logical axes of the serving caches -> mesh axes. Each cache class declares its fields' logical axes beside its
# definition (`AXES` of KVCache, MambaCache, MLACache): KV pages split by heads like the projections that fill them;
# the pools of pages and Mamba state slots split over the data-parallel groups, each group owning its own (the
# engine stacks the groups' pools on that axis).
CACHE_AXIS_RULES = {"kv_head": "tp", "page": "dp", "slot": "dp", None: None}


def _cache_mesh_axes(cache_type, field: str) -> tuple:
    logical = cache_type.AXES[field]
    unknown = [name for name in logical if name not in CACHE_AXIS_RULES]
    if unknown:
        raise ValueError(f"{cache_type.__name__}.{field} has logical axes {unknown} that no sharding rule maps "
                         f"(known: {sorted(n for n in CACHE_AXIS_RULES if n)})")
    return tuple(CACHE_AXIS_RULES[name] for name in logical)


def cache_partition_specs(cache_shapes: list, mesh) -> list:
    """The engine's per-layer caches of ShapeDtypeStructs (None for layers without one) -> the same structure with
    a PartitionSpec in place of each array."""
    def layer_specs(cache):
        specs = {field.name: _fit(_cache_mesh_axes(type(cache), field.name), getattr(cache, field.name).shape, mesh)
                 for field in dataclasses.fields(cache) if getattr(cache, field.name) is not None}
        return dataclasses.replace(cache, **specs)

    return [None if cache is None else layer_specs(cache) for cache in cache_shapes]


def param_partition_specs(params: dict, mesh) -> dict:
    """{dotted path: PartitionSpec} for a {dotted path: array or ShapeDtypeStruct} dict."""
    return {path: spec_for(path, tuple(value.shape), mesh) for path, value in params.items()}


def shard_params(params: dict, mesh) -> dict:
    """`params` placed on `mesh` by the rules."""
    specs = param_partition_specs(params, mesh)
    return {path: jax.device_put(value, NamedSharding(mesh, specs[path])) for path, value in params.items()}
