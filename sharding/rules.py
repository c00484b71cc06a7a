"""Partition rules: every param and cache names a logical axis per dimension where it is defined (a param's `axes`
metadata, a cache class's `AXES`); the tables here map logical axes to mesh axes.

Under `jax.jit` any sharding computes the same function (XLA inserts the collectives), so these rules are layout
choices for speed and memory, never for correctness:
- GQA attention projections split by heads over `tp` (columns of q/k/v, rows of o); MLA stays whole for now (its
  latent cache is shared by all heads, so a head split would still need every latent row on every device);
- Mamba mixers stay whole on every device of a `dp` group: their in_proj packs z|x|B|C|dt, which a column split
  would cut across, and their state is per request, so Mamba scales by splitting the batch over `dp` (each group
  its own requests and its own slice of the cache pools);
- dense MLPs split their hidden dimension over both axes; routed experts are split by expert over both axes
  (expert parallelism), falling back to the intermediate dimension when the expert count does not divide;
- embeddings and the LM head split the vocabulary over `tp`; norms, biases and routers are replicated.
A dimension is split only where its mesh axes divide it and no earlier dimension of the same array took one of
them; otherwise it is left whole rather than padded. That one rule gives the expert fallback: an expert stack
[E, in, inter] takes all devices on E when they divide it, else on each expert's intermediate dimension.
A block-scaled FP8 weight counts its dimensions in blocks: it is split only between blocks, exactly where its scales
(one per block, declaring the same axes) are, so that each device holds the scales of its own blocks.
A logical axis missing from a table is an error, never a silent replication.
"""

import dataclasses
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

ALL = ("dp", "tp")

# Logical axes of the params -> mesh axes.
PARAM_AXIS_RULES = {
    "vocab": "tp",  # embedding rows, LM head columns
    "heads": "tp",  # GQA q/k/v columns and o rows (heads x head_dim)
    "mlp": ALL,  # the hidden dimension of dense MLPs and shared experts
    "expert": ALL,  # the expert index of routed-expert stacks
    "expert_mlp": ALL,  # each routed expert's intermediate dimension, taken only where "expert" could not be
    "embed": None,  # the model width (in a latent MoE's experts, the latent width in its place)
    "mamba": None,  # every dimension of a Mamba mixer's own params
    "latent": None,  # low-rank latents: MLA's q / kv ranks, the latent MoE's projections
    "mla_heads": None,  # MLA's heads (q_b, kv_b, o)
    "indexer": None,  # the DSA indexer's heads and key
    "router_expert": None,  # router rows: top-k needs every expert's score on every device
    "norm": None,
    "bias": None,
}

# Logical axes of the serving caches -> mesh axes: KV pages split by heads like the projections that fill them;
# the pools of pages and Mamba state slots split over the data-parallel groups, each group owning its own (the
# engine stacks the groups' pools on that axis).
CACHE_AXIS_RULES = {"kv_head": "tp", "page": "dp", "slot": "dp", None: None}


def _names(mesh_axes) -> tuple:
    """A rule's mesh axes (None, one name or a tuple of names) as a tuple of names."""
    if mesh_axes is None:
        return ()
    return mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)


def _mesh_axes(rules: dict, logical: tuple, owner: str) -> tuple:
    """The mesh axes of each of `owner`'s logical axes; a ValueError naming `owner` for a name `rules` lacks."""
    unknown = [name for name in logical if name not in rules]
    if unknown:
        raise ValueError(f"{owner} has logical axes {unknown} that no sharding rule maps "
                         f"(known: {sorted(n for n in rules if n)})")
    return tuple(rules[name] for name in logical)


def manual_part(spec: P, axis: str) -> P:
    """What a shard_map manual over `axis` states of an array laid out by `spec` (a full mesh PartitionSpec of these
    rules): `axis` on the dimensions split over it, alone or with the other axis, else None. Exact because the
    rules split a dimension over both axes as ("dp", "tp"): a dp group's block is contiguous, and tp splits it."""
    return P(*(axis if axis in _names(axes) else None for axes in spec))


def _fit(mesh_axes: tuple, shape: tuple[int, ...], mesh) -> P:
    """The spec of an array of `shape` whose dimensions would take `mesh_axes`: each keeps its axes only where their
    devices divide it and no earlier dimension took one of them (else it stays whole)."""
    spec, taken = [], set()
    for axes, dim in zip(mesh_axes, shape):
        names = _names(axes)
        if names and dim % math.prod(mesh.shape[name] for name in names) == 0 and taken.isdisjoint(names):
            spec.append(axes)
            taken.update(names)
        else:
            spec.append(None)
    return P(*spec)


def spec_for(axes: tuple | None, shape: tuple[int, ...], mesh, *, param: str = "a param",
             block: tuple[int, ...] | None = None) -> P:
    """The PartitionSpec on `mesh` (only its `shape` is read) of the param `param` with logical `axes` and `shape`;
    `block` (the trailing dimensions' block sizes of a block-scaled weight) keeps splits between blocks."""
    if axes is None:
        raise ValueError(f"param {param} declares no logical axes: give it `axes` metadata where it is defined")
    if len(axes) != len(shape):
        raise ValueError(f"param {param} declares logical axes {axes} for its {len(shape)} dimensions {shape}")
    if block:
        sizes = (1,) * (len(shape) - len(block)) + tuple(block)
        shape = tuple(-(-dim // size) for dim, size in zip(shape, sizes))
    return _fit(_mesh_axes(PARAM_AXIS_RULES, axes, f"param {param}"), tuple(shape), mesh)


def param_partition_specs(params: dict, axes: dict, mesh, blocks: dict | None = None) -> dict:
    """{dotted path: PartitionSpec} for {dotted path: array or ShapeDtypeStruct} params whose logical axes are
    `axes` ({dotted path: axes}, see jaxmodels.nnx_params.param_axes) and `blocks` their block sizes, where they
    have one (jaxmodels.nnx_params.param_blocks)."""
    blocks = blocks or {}
    return {path: spec_for(axes.get(path), value.shape, mesh, param=path, block=blocks.get(path))
            for path, value in params.items()}


def shard_params(params: dict, axes: dict, mesh, blocks: dict | None = None) -> dict:
    """`params` placed on `mesh` by their logical `axes` (and `blocks`, see param_partition_specs)."""
    specs = param_partition_specs(params, axes, mesh, blocks)
    return {path: jax.device_put(value, NamedSharding(mesh, specs[path])) for path, value in params.items()}


def cache_partition_specs(cache_shapes: list, mesh) -> list:
    """The engine's per-layer caches of ShapeDtypeStructs (None for layers without one) -> the same structure with
    a PartitionSpec in place of each array, by each cache class's `AXES`."""
    def field_spec(cache, field: str) -> P:
        owner = f"{type(cache).__name__}.{field}"
        return _fit(_mesh_axes(CACHE_AXIS_RULES, type(cache).AXES[field], owner), getattr(cache, field).shape, mesh)

    def layer_specs(cache):
        return dataclasses.replace(cache, **{field.name: field_spec(cache, field.name)
                                             for field in dataclasses.fields(cache)
                                             if getattr(cache, field.name) is not None})

    return [None if cache is None else layer_specs(cache) for cache in cache_shapes]
