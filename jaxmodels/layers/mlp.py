"""Feed-forward blocks: the plain MLP (Nemotron-H) and the gated one (DeepSeek-style SwiGLU)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.layers.linear import ACTIVATIONS, linear


class MLP(nnx.Module):
    """Non-gated MLP `down(act(up(x)))` (Nemotron-H's `-` layers and shared experts; relu² by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, activation: str = "relu2"):
        self.up_proj = linear(hidden_size, intermediate_size, rngs=rngs, bias=bias, dtype=dtype)
        self.down_proj = linear(intermediate_size, hidden_size, rngs=rngs, bias=bias, dtype=dtype)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))


class GatedMLP(nnx.Module):
    """Gated MLP `down(act(gate(x)) * up(x))` (DeepSeek's dense layers and shared experts; SwiGLU by default)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 bias: bool = False, activation: str = "silu"):
        self.gate_proj = linear(hidden_size, intermediate_size, rngs=rngs, bias=bias, dtype=dtype)
        self.up_proj = linear(hidden_size, intermediate_size, rngs=rngs, bias=bias, dtype=dtype)
        self.down_proj = linear(intermediate_size, hidden_size, rngs=rngs, bias=bias, dtype=dtype)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
