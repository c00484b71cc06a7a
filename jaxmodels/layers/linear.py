"""Dense projections. Kernels are stored [in, out] (`kernel`), the transpose of torch's `weight`; the layers of an
FP8 checkpoint keep its FP8 [out, in] weights instead (layers/fp8_linear.py). `kernel_of` and `held_in_features`
read either kind."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels._dispatch import on_gpu
from pallas_kernels.grouped_matmul import relu2

# XLA's GPU simplifier turns a product of one row with a weight into multiply + reduce when the two hold fewer than
# this many elements together, and on the H200 the multiply is not fused into the column reduce that follows: the
# weight-sized product goes to memory and back. Nano-30B's shared expert (2688 x 3712, just under) took four fusions,
# 53 µs a layer at one sequence, for 40 MB of weights that a GEMM reads in ~10 µs.
XLA_GPU_VECTOR_PRODUCT_ELEMENTS = 10_000_000


class Linear(nnx.Linear):
    """`nnx.Linear` whose one-row products stay matrix products on the GPU (see XLA_GPU_VECTOR_PRODUCT_ELEMENTS):
    a single row is computed beside a row of zeros, fenced by optimization barriers so the simplifier cannot slice
    the zero row back off before it rewrites the product. Rows of a product are independent, so row 0 is the row's
    product; elsewhere (several rows, large weights, the CPU, whose compiler does not rewrite) it is `nnx.Linear`."""

    def __call__(self, x: jax.Array) -> jax.Array:
        if not (math.prod(x.shape[:-1]) == 1 and reduces_vector_products()
                and x.shape[-1] + math.prod(self.kernel.shape) < XLA_GPU_VECTOR_PRODUCT_ELEMENTS):
            return super().__call__(x)
        pair = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        out = jax.lax.optimization_barrier(super().__call__(jax.lax.optimization_barrier(pair)))
        return out[0].reshape(*x.shape[:-1], -1)


def reduces_vector_products() -> bool:
    """Whether the compiler rewrites small vector-matrix products (XLA's GPU compiler does; its CPU one does not)."""
    return on_gpu()


def linear(in_features: int, out_features: int, *, axes: tuple[str, str], rngs: nnx.Rngs, bias: bool = False,
           dtype=jnp.float32, precision=None) -> Linear:
    """A `Linear` (an `nnx.Linear`) whose parameters and arithmetic are in `dtype`.

    `axes` names the kernel's logical axes (in, out), which sharding.rules maps to mesh axes. A bias is declared
    "bias" whatever its kernel's split, and so replicated: it is one row, too small for its split to matter.

    Loaded models get their weights from the bridge (built under `nnx.eval_shape`, nothing is initialized); the
    initializer only matters for models built from scratch. `precision` pins the matmul precision of this layer
    (None: the model's, see jaxmodels.precision).
    """
    return Linear(
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


ACTIVATIONS = {"relu2": relu2, "silu": nnx.silu}
