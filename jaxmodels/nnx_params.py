"""nnx plumbing between modules and flat params: {dotted path: array} out of a module, its params' logical axes (and
block sizes), an abstract module (shapes only, no weight allocated) to load into, and the module back from its graphdef
and filled params."""

import jax
from flax import nnx


def param_path(key: tuple) -> str:
    return ".".join(str(part) for part in key)


def abstract_module(factory):
    """(graphdef, abstract state, {dotted path: ShapeDtypeStruct}) of the module `factory()` would build."""
    graphdef, state = nnx.split(nnx.eval_shape(factory))
    flat = {param_path(key): var.get_value() for key, var in nnx.to_flat_state(state)}
    return graphdef, state, flat


def merge_params(graphdef, abstract_state, params: dict):
    """The model with `params` (dotted path -> array) in place of the abstract state's leaves."""
    flat = nnx.to_flat_state(abstract_state)
    filled = [(key, var.replace(params[param_path(key)])) for key, var in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def model_params(model) -> dict:
    """{dotted path: array} of a built model's state."""
    return {param_path(key): var.get_value() for key, var in nnx.to_flat_state(nnx.state(model))}


def param_axes(model) -> dict:
    """{dotted path: logical axes} of a model's (or a state's) params: the `axes` metadata each param declares where
    it is defined (one name per dimension, see sharding.rules), None for a param that declares none."""
    return {param_path(key): var.get_metadata().get("axes") for key, var in nnx.to_flat_state(nnx.state(model))}


def param_blocks(model) -> dict:
    """{dotted path: block} of the params that declare one (block-scaled FP8 weights: sharding may cut them only
    between blocks, so that their scales split with them; see sharding.rules)."""
    flat = nnx.to_flat_state(nnx.state(model))
    return {param_path(key): var.get_metadata()["block"] for key, var in flat if var.get_metadata().get("block")}


def abstract_state(state):
    """`state` with a ShapeDtypeStruct in place of each array, its metadata kept: a structure for `merge_params`
    that keeps no weight alive."""
    return jax.tree.map(lambda value: jax.ShapeDtypeStruct(value.shape, value.dtype), state)
