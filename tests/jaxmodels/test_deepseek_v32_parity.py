"""DeepSeek-V3.2 / GLM-5 logits from `load_model` equal transformers' on tiny random checkpoints (float32, CPU).

Tolerance: max |ours - theirs| / max |theirs| < 1e-4. Both sides compute in float32 and differ only in summation
order (absorbed vs expanded attention products, grouped vs per-expert matmuls, the indexer's scale folded into its
head weights), which leaves ~1e-6 relative after three layers. The indexer's choices are discrete: they agree as
long as no two index scores sit within ~1e-6 of each other at the top-k boundary, which the fixed seeds avoid. One
key selected differently, a wrong rope layout, scale or routing choice moves logits by far more than 1e-4 (the
dense-attention test below shows by how much dropping the indexer alone does).

Variants: DeepSeek-V3.2 with grouped routing (4 groups, 2 chosen), the same with YaRN rope (mscale on the softmax
scale and on cos/sin), GLM-5 with interleaved indexer rope and a `shared` indexer layer. index_topk = 6, so prompts
of 1 and 4 tokens keep every key and 17 tokens drop most of them.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmodels
from tests.hf_models import logits_of, make_dsa, save
from tests.numerics import max_relative_error

TOLERANCE = 1e-4
VARIANTS = ["deepseek_v32", "deepseek_v32_yarn", "glm_moe_dsa"]


class Jitted:
    """`model(ids, mla_path=...)` compiled once per shape: op-by-op dispatch recompiles every op for every new prompt
    length, which made these tests four times slower. Same function, same numbers."""

    def __init__(self, model):
        graphdef, self.state = nnx.split(model)

        @functools.partial(jax.jit, static_argnames="mla_path")
        def forward(state, input_ids, mla_path):
            return nnx.merge(graphdef, state)(input_ids, mla_path=mla_path)

        self.forward = forward

    def __call__(self, input_ids, mla_path="absorbed"):
        return np.asarray(self.forward(self.state, np.asarray(input_ids, np.int32), mla_path))


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoint(request, tmp_path_factory):
    hf_model = make_dsa(request.param)
    path = save(hf_model, tmp_path_factory.mktemp(request.param))
    return request.param, hf_model, Jitted(jaxmodels.load_model(path, dtype="float32", progress=False))


def random_ids(hf_model, batch, seq_len, seed=None):
    rng = np.random.default_rng(seq_len if seed is None else seed)
    return rng.integers(0, hf_model.config.vocab_size, size=(batch, seq_len))


@pytest.mark.parametrize("seq_len", [1, 4, 6, 17])
def test_logits_match_transformers(checkpoint, seq_len):
    _, hf_model, model = checkpoint
    assert hf_model.config.index_topk == 6
    input_ids = random_ids(hf_model, 2, seq_len)
    expected = logits_of(hf_model, input_ids).numpy()
    got = np.asarray(model(input_ids))
    assert got.shape == expected.shape
    assert max_relative_error(got, expected) < TOLERANCE
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_expanded_path_matches_transformers(checkpoint):
    _, hf_model, model = checkpoint
    input_ids = random_ids(hf_model, 2, 17)
    expected = logits_of(hf_model, input_ids).numpy()
    assert max_relative_error(model(input_ids, mla_path="expanded"), expected) < TOLERANCE


def test_sparse_selection_matters(checkpoint):
    """The same weights with a top-k covering the whole prompt (dense causal attention) give clearly different
    logits at 17 tokens, and our sparse logits follow transformers' sparse ones, not the dense ones."""
    variant, hf_model, model = checkpoint
    dense_hf = make_dsa(variant, index_topk=64)  # same seed, same weights: index_topk shapes no parameter
    input_ids = random_ids(hf_model, 2, 17)
    sparse = logits_of(hf_model, input_ids).numpy()
    dense = logits_of(dense_hf, input_ids).numpy()
    assert max_relative_error(dense, sparse) > 100 * TOLERANCE
    assert max_relative_error(model(input_ids), sparse) < TOLERANCE
    # Up to top-k tokens nothing is dropped, so sparse and dense agree there.
    np.testing.assert_allclose(sparse[:, :6], dense[:, :6], rtol=0, atol=1e-5 * np.abs(dense).max())


def test_batch_rows_are_independent(checkpoint):
    _, hf_model, model = checkpoint
    input_ids = random_ids(hf_model, 3, 13, seed=7)
    batched = np.asarray(model(input_ids))
    for row in range(3):
        alone = np.asarray(model(input_ids[row : row + 1]))
        np.testing.assert_allclose(batched[row], alone[0], rtol=1e-5, atol=1e-5 * np.abs(alone).max())


def test_in_memory_and_converted_models_match(tmp_path):
    """`from_torch` reads transformers' in-memory layout (experts fused as `gate_up_proj`, unlike the per-expert
    tensors `save_pretrained` writes), and the orbax-converted copy restores the same params, bit for bit. (Logits
    are compared within rounding only: on the GPU two compilations of one program may autotune different GEMM
    algorithms.)"""
    from bridge import save_converted
    from jaxmodels.nnx_params import model_params

    hf_model = make_dsa("glm_moe_dsa")
    saved = jaxmodels.load_model(save(hf_model, tmp_path / "saved"), progress=False)
    assert any(name.endswith("experts.gate_up_proj") for name in hf_model.state_dict())
    in_memory = jaxmodels.from_torch(hf_model, progress=False)
    converted = tmp_path / "converted"
    save_converted(model_params(in_memory), converted, hf_model.config.to_dict(), dtype=in_memory.dtype)
    restored = jaxmodels.load_model(converted, progress=False)
    expected = model_params(saved)
    for other in (in_memory, restored):
        params = model_params(other)
        assert params.keys() == expected.keys()
        for name in expected:
            assert np.array_equal(params[name], expected[name]), name
    input_ids = random_ids(hf_model, 2, 9)
    assert max_relative_error(Jitted(restored)(input_ids), Jitted(saved)(input_ids)) < TOLERANCE
