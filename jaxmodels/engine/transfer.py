"""A step's host inputs in one transfer: the batch and sampling knobs (a pytree of small int32 / float32 / uint32 /
bool numpy arrays) packed into one int32 buffer on the host and unpacked inside the executables.

Why: each numpy argument of a jitted call is its own host-to-device copy, and each lands at a new device address;
XLA runs a step as a CUDA graph and must update the graph's nodes that read a moved argument before it launches
(XLA's command buffer thunk compares every argument's address with the recorded one). A decode step's positions,
slot ids and page table are read by kernels in every layer, so a new address for them touches hundreds of nodes.
One buffer means one copy; `stage=True` also copies it, first thing in the program, into the executable's own
temporary memory (a fusion that adds the buffer's trailing zero, which XLA cannot fold away, behind an optimization
barrier so no consumer fuses it back), and every other kernel reads that copy, whose address stays put.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_AS_INT32 = {np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32)}  # stored bit for bit


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """One int32 buffer holding a pytree of arrays; `layout` (static) says how to read it back.

    The buffer ends with one zero word (see the module docstring). On a mesh the buffer is [groups, words], one
    row per dp group, each packed with the same layout, and is unpacked inside the group's shard (one row)."""

    buffer: object
    layout: tuple  # (treedef, ((shape, dtype name), ...), stage)

    def tree_flatten(self):
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def unpack(self):
        """Inside a traced program: the pytree, as jax arrays."""
        treedef, fields, stage = self.layout
        words = jnp.reshape(self.buffer, (-1,))
        if stage:
            words = jax.lax.optimization_barrier(words + words[-1])
        leaves, offset = [], 0
        for shape, dtype in fields:
            size = math.prod(shape)
            part = words[offset: offset + size].reshape(shape)
            offset += size
            if dtype == "bool":
                part = part != 0
            elif dtype != "int32":
                part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
            leaves.append(part)
        return jax.tree.unflatten(treedef, leaves)


def pack_groups(trees: list, stage: bool = True) -> Packed:
    """Each dp group's pytree of numpy arrays (all with the same shapes) -> one Packed numpy buffer [groups, words]."""
    rows, layout = [], None
    for tree in trees:
        leaves, treedef = jax.tree.flatten(tree)
        fields = tuple((np.shape(leaf), np.asarray(leaf).dtype.name) for leaf in leaves)
        if layout is None:
            layout = (treedef, fields, stage)
        elif (treedef, fields) != layout[:2]:
            raise ValueError("dp groups' step inputs differ in shape; buckets must be the same in every group")
        words = [_as_words(np.asarray(leaf)) for leaf in leaves]
        rows.append(np.concatenate(words + [np.zeros(1, np.int32)]))
    return Packed(np.stack(rows), layout)


def _as_words(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.bool_:
        return array.astype(np.int32).reshape(-1)
    if array.dtype not in _AS_INT32:
        raise TypeError(f"cannot pack a {array.dtype} array into int32 words")
    return np.ascontiguousarray(array).view(np.int32).reshape(-1)
