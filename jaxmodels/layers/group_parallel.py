"""Feed-forward layers across data-parallel groups (DP attention).

Under the engine's data parallelism each `dp` group of devices runs attention and Mamba on its own requests (the
step runs inside a `shard_map` that is manual over the `dp` mesh axis), while MLP and MoE weights are split over all
devices: along the experts or the intermediate dimension, so that each group holds a slice of every feed-forward
layer. Such a layer must see every group's tokens. `across_groups` gathers them over `dp`, lets each group apply
its slice (whose outputs are partial sums of the full layer's: a slice of experts, or of the intermediate dimension
before a linear down projection), and reduce-scatters the sum back, each group keeping its own tokens' rows.

A part whose weights are whole in every group (a dimension the devices do not divide) runs on the group's own tokens
only; summing it over groups would count it dp times.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


def across_groups(x: jax.Array, dp_axis: str | None, parts: list[tuple[Callable, bool]]) -> jax.Array:
    """sum of fn(x) over `parts` = [(fn, split over dp groups)], for x[T, ...] the tokens of this group.

    Without a `dp_axis` (one group, or outside the engine's data-parallel step) every part runs on x.
    """
    if dp_axis is None:
        return sum(fn(x) for fn, _ in parts)
    whole = [fn for fn, split in parts if not split]
    sliced = [fn for fn, split in parts if split]
    out = sum(fn(x) for fn in whole) if whole else 0
    if sliced:
        everyone = lax.all_gather(x, dp_axis, axis=0, tiled=True)
        partial = sum(fn(everyone) for fn in sliced)
        out = out + _sum_scatter(partial, dp_axis)
    return out


def _sum_scatter(partial: jax.Array, dp_axis: str) -> jax.Array:
    """The sum of every group's `partial` rows, each group keeping its own rows' block."""
    return sum_over(partial, dp_axis, scatter=True)


def sum_over(partial: jax.Array, axis: str, *, scatter: bool = False) -> jax.Array:
    """The sum of every device's `partial` over the mesh axis `axis` (with `scatter`, each keeping its own block of
    the leading dimension).

    On the CPU a 16-bit sum is taken in float32 here: there XLA widens 16-bit all-reduces to float32 itself
    (AllReducePromotion, after the reduce-scatter became an all-reduce), and under the engine's partly manual
    shard_map the reducer carries a sharding annotation that pass cannot clone: the process aborts ("Invalid binary
    instruction opcode copy", jax 0.10.2, a bf16 model at dp=2 on simulated devices). Widening first gives the sum
    that pass would have given. GPUs reduce in the given dtype (half the bytes)."""
    def reduce(value):
        if scatter:
            return lax.psum_scatter(value, axis, scatter_dimension=0, tiled=True)
        return lax.psum(value, axis)

    if jax.default_backend() == "cpu" and partial.dtype.itemsize < 4:
        return reduce(partial.astype(jnp.float32)).astype(partial.dtype)
    return reduce(partial)
