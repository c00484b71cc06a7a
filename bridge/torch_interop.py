"""torch <-> jax through DLPack.

DLPack shares the buffer when both frameworks sit on the same device (CPU tensors into CPU jax, CUDA tensors into
GPU jax): no copy is made. Across devices jax copies.
"""

import jax
import jax.numpy as jnp
import numpy as np


def torch_to_jax(tensor) -> jax.Array:
    """A jax array viewing `tensor`'s memory (zero-copy where the devices allow)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == _torch().bool:
        return jnp.asarray(tensor.numpy())  # bool is not in every DLPack version
    return jax.dlpack.from_dlpack(tensor)


def jax_to_torch(array: jax.Array):
    """A torch tensor viewing `array`'s memory (zero-copy where the devices allow)."""
    return _torch().from_dlpack(array)


def torch_to_numpy(tensor) -> np.ndarray:
    """Host numpy copy of any torch tensor, bfloat16 included (numpy has no bf16: it goes through jax/ml_dtypes)."""
    return np.asarray(torch_to_jax(tensor.cpu()))


def _torch():
    import torch

    return torch

