"""Multi-token-prediction drafts (`mtp_step`) from `load_model` equal a torch reference assembled from transformers'
own layer classes (tests/hf_mtp.py), on tiny random checkpoints whose MTP tensors the tests append under their
published names (float32, CPU).

Tolerance: max |ours - theirs| / max |theirs| < 1e-4, as in the model parity tests. Both sides compute in float32 and
differ only in summation order, which leaves ~1e-6 relative after the target's layers and two chained drafts; a
swapped concatenation, a missing norm or the target state taken before its final norm moves the logits by order 1.

Variants: DeepSeek-V3.2 and GLM-5 with one MTP layer (index_topk = 6, so its indexer drops keys of the 13-token
prompts), Nemotron-H MoE with an attention + MoE MTP layer. 13 tokens: a prime, a multiple of no chunk or page size.
Two chained drafts: the second reuses the one MTP layer at depth 1, on the first one's output.
"""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

import jaxmodels
from tests.hf_mtp import VARIANTS, chained_draft_logits, save_with_mtp
from tests.numerics import max_relative_error

TOLERANCE = 1e-4
SEQ_LEN = 13
DEPTHS = 2


@pytest.fixture(scope="module", params=VARIANTS)
def case(request, tmp_path_factory) -> dict:
    """The checkpoint's model and its inputs, with the reference's chained drafts on them."""
    path = tmp_path_factory.mktemp(request.param)
    target, mtp_layer = save_with_mtp(request.param, path)
    input_ids = np.random.default_rng(3).integers(0, target.config.vocab_size, size=(2, SEQ_LEN))
    return dict(variant=request.param, target=target, model=jaxmodels.load_model(path, progress=False),
                input_ids=input_ids, expected=[logits.numpy() for logits in
                                               chained_draft_logits(target, mtp_layer, input_ids, DEPTHS)])


def our_drafts(model, input_ids, **options) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the target's hidden states, the chained drafts' logits), compiled as one program: op by op, every op would
    compile again for each length along the chain."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def drafts(state, input_ids):
        model = nnx.merge(graphdef, state)
        hidden = target_hidden = model.hidden_states(input_ids, **options)
        logits = []
        for depth in range(DEPTHS):
            depth_logits, hidden = model.mtp_step(hidden[:, :-1], input_ids[:, depth + 1 :], depth=depth, **options)
            logits.append(depth_logits)
        return target_hidden, logits

    return jax.device_get(drafts(state, np.asarray(input_ids, np.int32)))


@pytest.fixture(scope="module")
def ours(case) -> tuple[np.ndarray, list[np.ndarray]]:
    return our_drafts(case["model"], case["input_ids"])


def test_model_has_the_declared_mtp_layer(case):
    assert case["model"].num_mtp_layers == 1


def test_hidden_states_are_the_final_normed_ones(case, ours):
    """What the MTP layers read: transformers' `last_hidden_state`, after the final norm."""
    with torch.no_grad():
        expected = case["target"].model(torch.as_tensor(case["input_ids"])).last_hidden_state.numpy()
    assert max_relative_error(ours[0], expected) < TOLERANCE


@pytest.mark.parametrize("depth", range(DEPTHS))
def test_chained_drafts_match_reference(case, ours, depth):
    expected, got = case["expected"][depth], ours[1][depth]
    assert got.shape == expected.shape == (2, SEQ_LEN - 1 - depth, case["target"].config.vocab_size)
    assert max_relative_error(got, expected) < TOLERANCE


def test_expanded_mla_path_matches_reference(case):
    """`mtp_step` passes the family's options on: here DeepSeek's `mla_path` (its two paths are compared layer by
    layer in test_deepseek_v32_parity; one variant shows the option reaches the MTP layer)."""
    if case["variant"] != "deepseek_v32":
        pytest.skip("one DSA variant covers the option")
    _, logits = our_drafts(case["model"], case["input_ids"], mla_path="expanded")
    assert max_relative_error(logits[-1], case["expected"][-1]) < TOLERANCE
