"""A Mamba2 layer's VERIFY step (speculative decoding) against the decode path it stands for: the outputs of L
tokens from each slot's state equal L decode steps' outputs, the pools stay as they were, and committing a of the
drafts leaves exactly the conv window and SSM state of a + 1 decode steps, for every a from 0 to L - 1 (float32, CPU;
both run the decode recurrence, but in different XLA fusions, which may contract products into FMAs differently:
hence a relative tolerance, 1e-5, a hundred float32 roundings)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodels.layers.mamba2 import MambaCache, Mamba2Mixer
from jaxmodels.step_context import StepContext
from tests.numerics import max_relative_error

TOLERANCE = 1e-5


def test_verify_then_commit_equals_decode_steps():
    length, slots, pages_per_seq = 4, 5, 2
    mixer = Mamba2Mixer(hidden_size=24, num_heads=6, head_dim=6, state_size=8, n_groups=3, conv_kernel=4,
                        chunk_size=2, dt_limit=(0.001, math.inf), eps=1e-5, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    shapes = mixer.cache_shape(slots, jnp.float32, jnp.float32)
    cache = MambaCache(conv=jnp.asarray(rng.normal(size=shapes.conv.shape), jnp.float32),
                       ssm=jnp.asarray(rng.normal(size=shapes.ssm.shape), jnp.float32))
    slot_ids = jnp.array([3, 1, 4, 2], jnp.int32)  # one request per accepted count 0..3
    accepted = jnp.arange(length, dtype=jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(len(slot_ids), length, 24)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(10, 10 + length), (len(slot_ids), length))
    step = StepContext.verify(positions=positions, page_table=jnp.zeros((len(slot_ids), pages_per_seq), jnp.int32),
                              slot_ids=slot_ids, prompt_lens=jnp.full(len(slot_ids), 5, jnp.int32))
    out, pending = jax.jit(mixer.forward_verify)(hidden.reshape(-1, 24), step, cache)
    np.testing.assert_array_equal(pending.ssm, cache.ssm)
    np.testing.assert_array_equal(pending.conv, cache.conv)
    committed = jax.jit(mixer.commit_verified)(pending, slot_ids, accepted)

    decode = jax.jit(mixer.forward_decode)
    conv, ssm, expected_out, after = cache.conv, cache.ssm, [], []
    for i in range(length):
        y, conv, ssm = decode(hidden[:, i], conv, ssm, slot_ids)
        expected_out.append(y)
        after.append((conv, ssm))
    assert max_relative_error(out.reshape(len(slot_ids), length, 24), jnp.stack(expected_out, 1)) < TOLERANCE
    for row, slot in enumerate(np.asarray(slot_ids)):
        conv_a, ssm_a = after[int(accepted[row])]
        np.testing.assert_allclose(committed.conv[slot], conv_a[slot], rtol=0, atol=0)
        assert max_relative_error(committed.ssm[slot], ssm_a[slot]) < TOLERANCE
    untouched = np.setdiff1d(np.arange(slots), np.asarray(slot_ids))
    np.testing.assert_array_equal(committed.ssm[untouched], cache.ssm[untouched])
    np.testing.assert_array_equal(committed.conv[untouched], cache.conv[untouched])
