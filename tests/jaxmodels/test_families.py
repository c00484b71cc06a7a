"""The family table refuses a `model_type` it does not hold, naming the ones it does."""

import pytest

from jaxmodels.configs import ConfigError
from jaxmodels.families import load_config


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match=r"'llama'.*supported: \['deepseek_v32', 'glm_moe_dsa', 'nemotron_h'\]"):
        load_config({"model_type": "llama"})
