"""Linear layers and expert stacks whose weights stay FP8, as an FP8 checkpoint stores them.

The weight keeps the checkpoint's float8_e4m3fn [out, in] layout (experts stacked: [E, out, in]) and its float32
scales, under the checkpoint's names, so that the bridge maps them by name: block-scaled `weight_scale_inv` (one per
block, see jaxmodels.configs.quantization), or per-tensor `weight_scale` with the static `input_scale`. The products
run through `pallas_kernels.fp8_matmul` / `fp8_grouped_matmul`, which quantize the activations on the fly.

Scales declare the logical axes of the weight dimensions they cover, so they shard with their weights; a
block-scaled weight also declares its `block`, so that sharding only cuts it between blocks (sharding.rules).
"""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxmodels.configs.quantization import Fp8Config


class Fp8Weights(nnx.Module):
    """A weight [*lead, out, in] in FP8 with its scales. `axes` names the logical axes of (*lead, in, out), the
    order of our dense kernels: the FP8 weight swaps the last two."""

    def __init__(self, lead: tuple[int, ...], in_features: int, out_features: int, *, fp8: Fp8Config,
                 axes: tuple[str, ...], dtype):
        self.in_features, self.out_features, self.dtype = in_features, out_features, jnp.dtype(dtype)
        self.dense_axes = tuple(axes)  # the dense layer's, for going back to it (jaxmodels.quantization)
        self.block, self.pow2_scales = fp8.block, fp8.pow2_scales
        weight_axes = (*axes[:-2], axes[-1], axes[-2])
        self.weight = nnx.Param(jnp.zeros((*lead, out_features, in_features), jnp.float8_e4m3fn), axes=weight_axes,
                                block=fp8.block)
        if fp8.block:
            grid = (math.ceil(out_features / fp8.block[0]), math.ceil(in_features / fp8.block[1]))
            self.weight_scale_inv = nnx.Param(jnp.ones((*lead, *grid), jnp.float32), axes=weight_axes)
        else:
            self.weight_scale = nnx.Param(jnp.ones(lead, jnp.float32), axes=tuple(axes[:-2]))
            self.input_scale = nnx.Param(jnp.ones(lead, jnp.float32), axes=tuple(axes[:-2]))

    def scales(self) -> dict:
        """The scale arguments of the FP8 GEMMs."""
        if self.block:
            return dict(w_scale=self.weight_scale_inv[...], block=self.block, pow2_scales=self.pow2_scales)
        return dict(w_scale=self.weight_scale[...], block=None, input_scale=self.input_scale[...])

    def dequantized(self) -> jax.Array:
        """The weight in the model dtype, in our dense layout [*lead, in, out] (w8 · scale, rounded once)."""
        scale = self.weight_scale_inv[...] if self.block else self.weight_scale[...]
        dense = pallas_kernels.dequantize_weight(self.weight[...], scale, self.block)
        return jnp.swapaxes(dense, -1, -2).astype(self.dtype)

    def set_quantized(self, dense: jax.Array) -> None:
        """Hold `dense` (our dense layout [*lead, in, out]) quantized to this layer's block format: an FP8 model made
        from a dense one (benchmarks on random weights). Per-tensor FP8 would need its input scales calibrated."""
        if not self.block:
            raise ValueError("only block-scaled FP8 weights are made from dense ones (per-tensor FP8 needs "
                             "calibrated input scales)")
        w8, scale = _quantized_matrices(dense, self.block)
        self.weight.set_value(w8)
        self.weight_scale_inv.set_value(scale)

    @property
    def held_in_features(self) -> int:
        """The input width this device holds (a slice under a data-parallel split)."""
        return self.weight.shape[-1]


@functools.partial(jax.jit, static_argnames="block")
def _quantized_matrices(dense: jax.Array, block: tuple[int, int]):
    """(w8[*lead, out, in], scales) of dense [*lead, in, out], one matrix at a time: the float32 temporaries of a
    whole expert stack would not fit beside the model."""
    lead, (fan_in, fan_out) = dense.shape[:-2], dense.shape[-2:]
    w8, scale = jax.lax.map(lambda m: pallas_kernels.quantize_weight(m.T, block), dense.reshape(-1, fan_in, fan_out))
    return w8.reshape(*lead, *w8.shape[1:]), scale.reshape(*lead, *scale.shape[1:])


class Fp8Linear(Fp8Weights):
    """The FP8 counterpart of `linear.linear`: y = x Wᵀ (+ bias, kept in the model dtype), in the model dtype."""

    def __init__(self, in_features: int, out_features: int, *, fp8: Fp8Config, axes: tuple[str, str],
                 bias: bool = False, dtype=jnp.float32):
        super().__init__((), in_features, out_features, fp8=fp8, axes=axes, dtype=dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), axes=("bias",)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        y = pallas_kernels.fp8_matmul(rows, self.weight[...], **self.scales())
        if self.bias is not None:
            y = y + self.bias[...]
        return y.reshape(*x.shape[:-1], -1)


class Fp8ExpertStack(Fp8Weights):
    """One projection of E routed experts, [E, out, in] in FP8 (the checkpoint's per-expert tensors, stacked)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, fp8: Fp8Config,
                 axes: tuple[str, str, str], dtype):
        super().__init__((num_experts,), in_features, out_features, fp8=fp8, axes=axes, dtype=dtype)

    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows[M, in] sorted by expert (see pallas_kernels.grouped_matmul) -> [M, out]."""
        return pallas_kernels.fp8_grouped_matmul(rows, self.weight[...], group_sizes=group_sizes, **self.scales())
