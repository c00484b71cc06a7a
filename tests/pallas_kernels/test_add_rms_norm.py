"""add_rms_norm: the Pallas kernel (interpret mode on CPU) against the XLA reference, which is the models' norm."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import add_rms_norm
from pallas_kernels.add_rms_norm import rms_norm
from tests.numerics import rms_relative_error


@pytest.mark.parametrize("scale_in_float32", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 4e-3)])
def test_kernel_equals_the_add_then_the_norm(scale_in_float32, dtype, tolerance):
    """D = 40 (not a power of two: masked lanes), leading dims flattened; the sum is the add's own rounding, bit for
    bit; the norm differs only by the order of its float32 sum (and, in bf16, that rounding's last bit)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 3, 40)), dtype)
    residual = jnp.asarray(rng.standard_normal((2, 3, 40)) * 4, dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, 40), dtype)
    kw = dict(eps=1e-5, scale_in_float32=scale_in_float32)
    summed, normed = add_rms_norm(x, residual, weight, impl="pallas", interpret=True, **kw)
    expected = residual + x
    assert summed.dtype == dtype and np.array_equal(np.asarray(summed, np.float32), np.asarray(expected, np.float32))
    reference = rms_norm(expected, weight, **kw)
    assert normed.dtype == reference.dtype
    assert rms_relative_error(np.asarray(normed, np.float32), np.asarray(reference, np.float32)) < tolerance


def test_reference_is_the_add_then_the_norm():
    rng = np.random.default_rng(1)
    x, residual = (jnp.asarray(rng.standard_normal((5, 16)), jnp.float32) for _ in range(2))
    weight = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32)
    summed, normed = add_rms_norm(x, residual, weight, eps=1e-6, impl="xla")
    assert np.array_equal(np.asarray(summed), np.asarray(residual + x))
    assert np.array_equal(np.asarray(normed), np.asarray(rms_norm(residual + x, weight, eps=1e-6)))


def test_mismatched_inputs_are_an_error():
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8), jnp.bfloat16), jnp.ones(8), eps=1e-6)
    with pytest.raises(ValueError, match="do not match"):
        add_rms_norm(jnp.zeros((2, 8)), jnp.zeros((2, 8)), jnp.ones(4), eps=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, width", [(1, 2688), (256, 4480), (3, 7168)])
@pytest.mark.parametrize("scale_in_float32", [True, False])
def test_compiled_kernel_on_gpu(rows, width, scale_in_float32):
    """The model widths (Nano-30B, Nano-9B, DeepSeek), one to 256 rows, bf16: the sum bit for bit, the norm within
    the last bit of its bf16 rounding."""
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((rows, width)) * 4, jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, width), jnp.bfloat16)
    kw = dict(eps=1e-5, scale_in_float32=scale_in_float32)
    summed, normed = add_rms_norm(x, residual, weight, impl="pallas", **kw)
    ref_sum, ref_norm = add_rms_norm(x, residual, weight, impl="xla", **kw)
    assert np.array_equal(np.asarray(summed, np.float32), np.asarray(ref_sum, np.float32))
    assert rms_relative_error(np.asarray(normed, np.float32), np.asarray(ref_norm, np.float32)) < 4e-3
