"""Nemotron-H logits from `load_model` equal transformers' on tiny random checkpoints (float32, CPU).

Tolerance: max |ours - theirs| / max |theirs| < 1e-4. Both sides compute in float32; they differ only in summation
order (chunked SSD vs transformers' einsums, grouped vs per-expert matmuls), which leaves errors of order 1e-6
relative after a handful of layers. A wrong mask, gate or routing choice moves logits by far more than 1e-4.
"""

import numpy as np
import pytest

import jaxmodels
from tests.hf_models import logits_of, make_nemotron_h, save
from tests.numerics import max_relative_error

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["dense", "moe", "latent_moe"])
def checkpoint(request, tmp_path_factory):
    hf_model = make_nemotron_h(request.param)
    path = save(hf_model, tmp_path_factory.mktemp(request.param))
    return hf_model, jaxmodels.load_model(path, dtype="float32", progress=False)


# chunk_size is 8: lengths 1, below, equal to, just above and several chunks plus a remainder.
@pytest.mark.parametrize("seq_len", [1, 5, 8, 11, 27])
def test_logits_match_transformers(checkpoint, seq_len):
    hf_model, model = checkpoint
    rng = np.random.default_rng(seq_len)
    input_ids = rng.integers(0, hf_model.config.vocab_size, size=(2, seq_len))
    expected = logits_of(hf_model, input_ids).numpy()
    got = np.asarray(model(input_ids))
    assert got.shape == expected.shape
    assert max_relative_error(got, expected) < TOLERANCE
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_batch_rows_are_independent(checkpoint):
    hf_model, model = checkpoint
    rng = np.random.default_rng(7)
    input_ids = rng.integers(0, hf_model.config.vocab_size, size=(3, 13))
    batched = np.asarray(model(input_ids))
    for row in range(3):
        alone = np.asarray(model(input_ids[row : row + 1]))
        np.testing.assert_allclose(batched[row], alone[0], rtol=1e-5, atol=1e-5 * np.abs(alone).max())


def test_tie_word_embeddings_flag_is_ignored_like_transformers(tmp_path):
    """transformers' NemotronH keeps a separate LM head even when the config asks for tied embeddings."""
    hf_model = make_nemotron_h("dense", seed=4, tie_word_embeddings=True, hybrid_override_pattern="M*M")
    assert hf_model.lm_head.weight.data_ptr() != hf_model.model.embeddings.weight.data_ptr()
    model = jaxmodels.load_model(save(hf_model, tmp_path), progress=False)
    input_ids = np.random.default_rng(1).integers(0, hf_model.config.vocab_size, size=(2, 11))
    assert max_relative_error(model(input_ids), logits_of(hf_model, input_ids).numpy()) < TOLERANCE
