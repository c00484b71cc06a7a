"""Each Nemotron-H layer against the matching transformers module, on the same (random) weights, float32."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge.checkpoint import dict_reader
from bridge.loader import load_params
from bridge.torch_interop import torch_to_numpy
from jaxmodels.configs import NemotronHConfig
from jaxmodels.models.nemotron_h import build_mixer
from jaxmodels.layers.norms import GatedGroupRMSNorm, RMSNorm
from jaxmodels.nnx_params import abstract_module, merge_params
from tests.hf_models import make_nemotron_h
from tests.numerics import max_relative_error
from flax import nnx

TOLERANCE = 1e-5  # one layer in float32: only summation order differs
pytestmark = pytest.mark.usefixtures("float32_matmuls")


def ours_with_weights_of(factory, torch_module):
    graphdef, state, abstract = abstract_module(factory)
    reader = dict_reader(torch_module.state_dict(), type(torch_module).__name__, to_numpy=torch_to_numpy)
    return merge_params(graphdef, state, load_params(reader, abstract, progress=False))


def assert_close(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), theirs.detach().double().numpy()
    assert ours.shape == theirs.shape
    assert max_relative_error(ours, theirs) <= TOLERANCE


@pytest.fixture(scope="module", params=["dense", "moe", "latent_moe"])
def hf_model(request):
    return make_nemotron_h(request.param, seed=3)


def random_hidden(hf_model, seq_len=19, batch=2):
    torch.manual_seed(seq_len)
    return torch.randn(batch, seq_len, hf_model.config.hidden_size)


def test_each_mixer_matches(hf_model):
    config = NemotronHConfig.from_hf(hf_model.config.to_dict())
    x = random_hidden(hf_model)
    for index, (kind, block) in enumerate(zip(config.layer_types, hf_model.model.layers)):
        ours = ours_with_weights_of(lambda: build_mixer(config, kind, rngs=nnx.Rngs(0), dtype=jnp.float32),
                                    block.mixer)
        with torch.no_grad():
            if kind == "attention":
                # transformers' attention takes its causal mask from the model; pass the same one.
                mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
                theirs = block.mixer(x, attention_mask=mask)[0]
            else:
                theirs = block.mixer(x)
        assert_close(ours(jnp.asarray(x.numpy())), theirs), f"layer {index} ({kind})"


def test_rms_norm_matches(hf_model):
    block = hf_model.model.layers[0]
    with torch.no_grad():
        block.norm.weight.copy_(torch.randn_like(block.norm.weight))
    ours = ours_with_weights_of(lambda: RMSNorm(hf_model.config.hidden_size, hf_model.config.layer_norm_epsilon),
                                block.norm)
    x = random_hidden(hf_model)
    with torch.no_grad():
        assert_close(ours(jnp.asarray(x.numpy())), block.norm(x))


def test_gated_group_norm_matches(hf_model):
    mixer = hf_model.model.layers[0].mixer
    with torch.no_grad():
        mixer.norm.weight.copy_(torch.randn_like(mixer.norm.weight))
    size = mixer.intermediate_size
    ours = ours_with_weights_of(
        lambda: GatedGroupRMSNorm(size, size // mixer.n_groups, hf_model.config.layer_norm_epsilon), mixer.norm)
    torch.manual_seed(1)
    y, z = torch.randn(2, 5, size), torch.randn(2, 5, size)
    with torch.no_grad():
        assert_close(ours(jnp.asarray(y.numpy()), jnp.asarray(z.numpy())), mixer.norm(y, z))
