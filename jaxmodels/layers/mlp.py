"""Feed-forward blocks: the plain MLP (Nemotron-H) and the gated one (DeepSeek-style SwiGLU)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.group_parallel import across_groups
from jaxmodels.layers.linear import ACTIVATIONS, held_in_features, linear


class _FeedForward(nnx.Module):
    """What both MLPs share: run on this group's tokens, or across dp groups when the intermediate dimension is
    split over them (see group_parallel). Subclasses define `forward` and set `intermediate_size`."""

    def is_split(self) -> bool:
        """Whether this group holds a slice of the intermediate dimension. A slice's output is a partial sum only
        without an output bias, which every group would add again."""
        split = held_in_features(self.down_proj) < self.intermediate_size
        if split and self.down_proj.bias is not None:
            raise NotImplementedError("an MLP with biases cannot be split over dp groups; use tp")
        return split

    def __call__(self, x: jax.Array, dp_axis: str | None = None) -> jax.Array:
        return across_groups(x, dp_axis, [(self.forward, self.is_split())])


class MLP(_FeedForward):
    """Non-gated MLP `down(act(up(x)))` (Nemotron-H's `-` layers and shared experts; relu² by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, activation: str = "relu2"):
        self.up_proj = linear(hidden_size, intermediate_size, axes=("embed", "mlp"), rngs=rngs, bias=bias,
                              dtype=dtype)
        self.down_proj = linear(intermediate_size, hidden_size, axes=("mlp", "embed"), rngs=rngs, bias=bias,
                                dtype=dtype)
        self.activation, self.intermediate_size = activation, intermediate_size

    def forward(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))


class GatedMLP(_FeedForward):
    """Gated MLP `down(act(gate(x)) * up(x))` (DeepSeek's dense layers and shared experts; SwiGLU by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, activation: str = "silu"):
        self.gate_proj = linear(hidden_size, intermediate_size, axes=("embed", "mlp"), rngs=rngs, bias=bias,
                                dtype=dtype)
        self.up_proj = linear(hidden_size, intermediate_size, axes=("embed", "mlp"), rngs=rngs, bias=bias,
                              dtype=dtype)
        self.down_proj = linear(intermediate_size, hidden_size, axes=("mlp", "embed"), rngs=rngs, bias=bias,
                                dtype=dtype)
        self.activation, self.intermediate_size = activation, intermediate_size

    def forward(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
