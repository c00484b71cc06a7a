"""Packed-batch bookkeeping shared by the kernels, their references and the engine steps."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.packing import (
    SHORT_PREFIX_SUM, aligned_blocks, num_blocks_bound, prefix_sum, token_sequence_ids, token_sequences)

CU = [0, 1, 9, 20, 20, 33]  # sequences of 1, 8, 11, 0 and 13 tokens; tokens 33.. of 40 are padding


def test_token_sequence_ids_are_searchsorted_without_a_loop():
    expected = np.searchsorted(np.asarray(CU[1:]), np.arange(40), side="right")
    np.testing.assert_array_equal(np.asarray(token_sequence_ids(jnp.asarray(CU, jnp.int32), 40)), expected)


def test_padding_tokens_belong_to_no_sequence():
    seq = np.asarray(token_sequence_ids(jnp.asarray(CU, jnp.int32), 40))
    assert set(seq[33:]) == {len(CU) - 1}


def test_token_sequences_clamp_padding_to_the_last_sequence_and_flag_it():
    seq, offset, real = (np.asarray(a) for a in token_sequences(jnp.asarray(CU, jnp.int32), 40))
    ids = np.asarray(token_sequence_ids(jnp.asarray(CU, jnp.int32), 40))
    np.testing.assert_array_equal(seq, np.minimum(ids, len(CU) - 2))
    np.testing.assert_array_equal(real, np.arange(40) < CU[-1])
    # Within each sequence the offsets count 0, 1, ...; padding tokens continue past the last sequence (from 20).
    np.testing.assert_array_equal(offset, [0] + list(range(8)) + list(range(11)) + list(range(20)))


def test_aligned_blocks_never_mix_sequences_and_cover_every_token_once():
    blocks = {k: np.asarray(v) for k, v in aligned_blocks(jnp.asarray(CU, jnp.int32), 40, 8).items()}
    assert len(blocks["seq"]) == num_blocks_bound(40, 5, 8)
    covered = np.zeros(40, int)
    for s, start, length in zip(blocks["seq"], blocks["start"], blocks["length"]):
        if length:
            assert CU[s] <= start
            assert start + length <= CU[s + 1]
            covered[start:start + length] += 1
    np.testing.assert_array_equal(covered, [1] * 33 + [0] * 7)


def test_aligned_blocks_mark_each_sequences_first_and_last_block():
    blocks = {k: np.asarray(v) for k, v in aligned_blocks(jnp.asarray(CU, jnp.int32), 40, 8).items()}
    np.testing.assert_array_equal(blocks["nblocks"], [1, 1, 2, 0, 2])
    firsts = [(s, start) for s, start, f in zip(blocks["seq"], blocks["start"], blocks["first"]) if f]
    lasts = [s for s, f in zip(blocks["seq"], blocks["last"]) if f]
    assert firsts == [(0, 0), (1, 1), (2, 9), (4, 20)]
    assert lasts == [0, 1, 2, 4]


def test_aligned_blocks_of_a_packing_with_an_empty_sequence():
    """The paged-attention kernel's query blocks. Sequences of 5, 0, 3 and 1 tokens, 3 padding tokens, blocks of 4:
    the bound is (12 + 4 * 3) // 4 = 6 blocks."""
    blocks = aligned_blocks(jnp.array([0, 5, 5, 8, 9], jnp.int32), num_tokens=12, block=4)
    np.testing.assert_array_equal(np.asarray(blocks["length"]), [4, 1, 3, 1, 0, 0])
    np.testing.assert_array_equal(np.asarray(blocks["start"])[:4], [0, 4, 5, 8])
    np.testing.assert_array_equal(np.asarray(blocks["seq"])[:4], [0, 0, 2, 3])


@pytest.mark.parametrize("n", [1, 7, 257, SHORT_PREFIX_SUM, SHORT_PREFIX_SUM + 1])
def test_prefix_sum_equals_cumsum(n):
    """Short integer vectors take the masked reduction, longer ones (and floats) the tree: both equal cumsum."""
    x = np.random.default_rng(n).integers(0, 1000, n).astype(np.int32)
    out = prefix_sum(jnp.asarray(x))
    assert out.dtype == jnp.int32
    assert np.array_equal(np.asarray(out), np.cumsum(x))
    rows = np.random.default_rng(0).standard_normal((3, n)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(prefix_sum(jnp.asarray(rows), axis=1)), np.cumsum(rows, axis=1),
                               rtol=1e-5, atol=1e-4 * np.sqrt(n))
