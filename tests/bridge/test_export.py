"""Our params written as an HF checkpoint load in transformers and give our logits (the demo relies on this)."""

import numpy as np
import torch
from flax import nnx

import jaxmodels
from bridge.export import save_hf_checkpoint
from jaxmodels.families import load_config
from jaxmodels.demo import DEMO_CONFIG
from jaxmodels.models.nemotron_h import NemotronHForCausalLM
from jaxmodels.nnx_params import model_params
from tests.numerics import max_relative_error


def test_export_round_trips_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = NemotronHForCausalLM(load_config(DEMO_CONFIG), rngs=nnx.Rngs(5))
    path = save_hf_checkpoint(model_params(model), DEMO_CONFIG, tmp_path,
                              base_prefix=NemotronHForCausalLM.HF_BASE_PREFIX)
    ids = np.random.default_rng(0).integers(0, DEMO_CONFIG["vocab_size"], size=(2, 37))

    reloaded = jaxmodels.load_model(path, progress=False)
    ours, again = model_params(model), model_params(reloaded)
    assert ours.keys() == again.keys()
    for name in ours:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(again[name]), err_msg=name)

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(model(ids))
    assert max_relative_error(got, expected) < 1e-4
