"""One-row products through `Linear`: beside a zero row where XLA's GPU compiler would rewrite them (see
jaxmodels.layers.linear), the same values, and on the GPU a matrix product instead of a weight-sized multiply."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodels.layers import linear as linear_module
from jaxmodels.layers.linear import linear

# Nano-30B's shared expert: the weight XLA's rewrite was measured on (just under its threshold).
SHARED_EXPERT = (2688, 3712)


def _layer(fan_in, fan_out, bias=False):
    layer = linear(fan_in, fan_out, axes=("embed", "mlp"), rngs=nnx.Rngs(0), bias=bias, dtype=jnp.float32)
    if bias:
        layer.bias.set_value(jax.random.normal(jax.random.key(1), (fan_out,)))
    return layer


def _has_barrier(layer, x) -> bool:
    """Whether the layer's traced product of x (arrays or shapes) goes through the zero-row path."""
    graph, state = nnx.split(layer)
    return "optimization_barrier" in str(jax.make_jaxpr(lambda s, v: nnx.merge(graph, s)(v))(state, x))


@pytest.mark.parametrize("shape", [(1, 64), (1, 1, 64), (64,)])
def test_one_row_takes_the_zero_row_where_the_compiler_would_rewrite(monkeypatch, shape):
    layer = _layer(64, 96, bias=True)
    x = jax.random.normal(jax.random.key(0), shape)
    with jax.default_matmul_precision("highest"):  # float32 products on the GPU too (its default is TF32)
        monkeypatch.setattr(linear_module, "reduces_vector_products", lambda: False)
        assert not _has_barrier(layer, x)
        plain = layer(x)
        monkeypatch.setattr(linear_module, "reduces_vector_products", lambda: True)
        assert _has_barrier(layer, x)
        paired = layer(x)
    assert paired.shape == plain.shape == (*shape[:-1], 96)
    # The same 64 products summed, perhaps in another order by a two-row kernel: within float32 rounding of the sum.
    np.testing.assert_allclose(np.asarray(paired), np.asarray(plain), rtol=0, atol=64 * 2.0**-24 * 8)


def test_several_rows_and_large_weights_keep_the_plain_product(monkeypatch):
    monkeypatch.setattr(linear_module, "reduces_vector_products", lambda: True)
    assert not _has_barrier(_layer(64, 96), jnp.ones((2, 64)))
    big = nnx.eval_shape(lambda: _layer(4096, 2688))  # 11.0M elements: XLA keeps it a GEMM
    assert not _has_barrier(big, jax.ShapeDtypeStruct((1, 4096), jnp.float32))
    small = nnx.eval_shape(lambda: _layer(*SHARED_EXPERT))
    assert _has_barrier(small, jax.ShapeDtypeStruct((1, SHARED_EXPERT[0]), jnp.float32))


@pytest.mark.gpu
def test_one_row_product_is_a_matrix_product_on_gpu():
    """The rewrite this works around: with `Linear`, no fusion of the optimized program multiplies a weight-sized
    array; the values equal the float32 product at HIGHEST precision within bf16 rounding of the output."""
    fan_in, fan_out = SHARED_EXPERT
    layer = nnx.eval_shape(lambda: linear(fan_in, fan_out, axes=("embed", "mlp"), rngs=nnx.Rngs(0),
                                          dtype=jnp.bfloat16))
    kernel = jax.random.normal(jax.random.key(0), SHARED_EXPERT, jnp.float32) / fan_in**0.5
    layer.kernel.set_value(kernel.astype(jnp.bfloat16))
    x = jax.random.normal(jax.random.key(1), (1, fan_in), jnp.float32).astype(jnp.bfloat16)
    graph, state = nnx.split(layer)
    run = jax.jit(lambda s, v: nnx.merge(graph, s)(v))
    hlo = run.lower(state, x).compile().as_text()
    weight_sized = re.findall(rf"= bf16\[{fan_in},{fan_out}\]\S* (?:fusion|multiply)", hlo)
    assert not weight_sized, weight_sized
    got = np.asarray(run(state, x), np.float32)
    want = np.asarray(jnp.dot(x.astype(jnp.float32), layer.kernel[...].astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST))
    # bf16 output: one bf16 step (2^-7 of the value) plus the float32 sum's rounding over 2688 terms.
    np.testing.assert_allclose(got, want, rtol=2.0**-7, atol=1e-3)
