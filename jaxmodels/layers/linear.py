"""Dense projections. Kernels are stored [in, out] (`kernel`), the transpose of torch's `weight`; the layers of an
FP8 checkpoint keep its FP8 [out, in] weights instead (layers/fp8_linear.py). `kernel_of` and `held_in_features`
read either kind."""

import jax
import jax.numpy as jnp
from flax import nnx


def linear(in_features: int, out_features: int, *, axes: tuple[str, str], rngs: nnx.Rngs, bias: bool = False,
           dtype=jnp.float32, precision=None) -> nnx.Linear:
    """An `nnx.Linear` whose parameters and arithmetic are in `dtype`.

    `axes` names the kernel's logical axes (in, out), which sharding.rules maps to mesh axes. A bias is declared
    "bias" whatever its kernel's split, and so replicated: it is one row, too small for its split to matter.

    Loaded models get their weights from the bridge (built under `nnx.eval_shape`, nothing is initialized); the
    initializer only matters for models built from scratch. `precision` pins the matmul precision of this layer
    (None: the model's, see jaxmodels.precision).
    """
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(0.02),
        precision=precision,
        kernel_metadata={"axes": axes},
        bias_metadata={"axes": ("bias",)},
        rngs=rngs,
    )


def kernel_of(layer) -> jax.Array:
    """The layer's kernel [in, out] in the model dtype: a dense layer's own, or an FP8 layer's dequantized."""
    return layer.kernel[...] if isinstance(layer, nnx.Linear) else layer.dequantized()


def held_in_features(layer) -> int:
    """The input width of the layer's weight on this device (a slice when a data-parallel split cuts it)."""
    return layer.kernel.shape[0] if isinstance(layer, nnx.Linear) else layer.held_in_features


def lm_logits(hidden, embedding: nnx.Embed, lm_head: nnx.Linear | None):
    """float32 logits from the LM head, or from the input embedding when the two are tied (no head)."""
    if lm_head is None:
        return embedding.attend(hidden).astype(jnp.float32)
    return lm_head(hidden).astype(jnp.float32)


def relu2(x):
    """Squared ReLU, the activation of Nemotron-H MLPs and experts."""
    return jnp.square(jnp.maximum(x, 0))


ACTIVATIONS = {"relu2": relu2, "silu": nnx.silu}
