"""Run in a subprocess with 2 simulated CPU devices: a bfloat16 model served with dp=2.

XLA's CPU compiler aborted the process on the bf16 reduce-scatter that brings the MoE / MLP outputs back to their
groups (`jaxmodels.layers.group_parallel._sum_scatter`): under the engine's partly manual shard_map the reducer
carries a sharding annotation that XLA's widening of 16-bit all-reduces cannot clone. Checked here: the layer's sum
in the engine's shard_map layout, within bf16 rounding of the exact one, and an LLM serving a bf16 MoE checkpoint at
dp=2 (which aborted before).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxmodels
from jaxmodels.layers.group_parallel import across_groups
from tests.hf_models import make_nemotron_h, save


def check_sum_scatter() -> None:
    """Each group holds a slice of a linear layer; the rows of every group come back with the whole layer's output.
    Bound per element: each group's bf16 partial and the bf16 sum are rounded to nearest (2^-8 of their magnitude
    each); twice that covers them, the float32 accumulation being far below it."""
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("dp", "tp"))  # the engine's (dp, tp) mesh at dp=2
    w = jax.random.normal(jax.random.key(0), (2, 64, 48), jnp.bfloat16)  # group g's slice: w[g]
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)  # rows 0-7 group 0's, 8-15 group 1's

    def step(rows, slices):
        return across_groups(rows, "dp", [(lambda t: t @ slices[0], True)])

    mapped = jax.shard_map(step, mesh=mesh, in_specs=(P("dp"), P("dp")), out_specs=P("dp"),
                           axis_names=frozenset({"dp"}), check_vma=False)
    got = np.asarray(jax.jit(mapped)(x, w), np.float64)
    partials = [np.asarray(x, np.float64) @ np.asarray(w[g], np.float64) for g in range(2)]
    want = partials[0] + partials[1]
    bound = 2.0 ** -7 * (np.abs(partials[0]) + np.abs(partials[1]) + np.abs(want))
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()
    print("bf16 sum over groups within its rounding")


def check_serving(directory: str) -> None:
    path = save(make_nemotron_h("moe"), f"{directory}/nemotron_h_moe")
    llm = jaxmodels.LLM(path, dtype="bfloat16", dp=2, max_batch_size=4, max_seq_len=32, max_prefill_tokens=8,
                        progress=False)
    outputs = llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], jaxmodels.SamplingParams(max_new_tokens=4,
                                                                                       temperature=0.0))
    assert [len(o.token_ids) for o in outputs] == [4, 4], outputs
    print("bf16 dp=2 serves")


if __name__ == "__main__":
    assert jax.device_count() == 2, jax.devices()
    check_sum_scatter()
    check_serving(sys.argv[1])
