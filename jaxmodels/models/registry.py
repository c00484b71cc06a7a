"""Architecture registry: which model class serves a config, and the nnx plumbing to build it from params."""

import jax.numpy as jnp
from flax import nnx

from jaxmodels.models.deepseek_v32 import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
from jaxmodels.models.nemotron_h import NemotronHForCausalLM

MODEL_CLASSES = {
    "nemotron_h": NemotronHForCausalLM,
    "deepseek_v32": DeepseekV32ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
}


def model_class(config):
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ValueError(f"no model for model_type {config.model_type!r}; supported: {sorted(MODEL_CLASSES)}")


def param_path(key: tuple) -> str:
    return ".".join(str(part) for part in key)


def abstract_model(config, dtype, matmul_precision: str | None = None):
    """(graphdef, abstract state, {dotted path: ShapeDtypeStruct}) of the model, allocating no weight."""
    dtype = jnp.dtype(dtype)
    return abstract_module(lambda: model_class(config)(config, dtype=dtype, matmul_precision=matmul_precision))


def abstract_module(factory):
    """(graphdef, abstract state, {dotted path: ShapeDtypeStruct}) of the module `factory()` would build."""
    graphdef, state = nnx.split(nnx.eval_shape(factory))
    flat = {param_path(key): var.get_value() for key, var in nnx.to_flat_state(state)}
    return graphdef, state, flat


def merge_params(graphdef, abstract_state, params: dict):
    """The model with `params` (dotted path -> array) in place of the abstract state's leaves."""
    flat = nnx.to_flat_state(abstract_state)
    filled = [(key, var.replace(params[param_path(key)])) for key, var in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(filled))


def model_params(model) -> dict:
    """{dotted path: array} of a built model's state."""
    return {param_path(key): var.get_value() for key, var in nnx.to_flat_state(nnx.state(model))}


def checkpoint_ignore_patterns(config) -> tuple[str, ...]:
    """Checkpoint tensors that exist but that the model does not use (regexes over normalized names)."""
    patterns = [r"rotary_emb\.inv_freq$"]
    if getattr(config, "tie_word_embeddings", False):
        patterns.append(r"^lm_head\.weight$")
    # Multi-token-prediction heads (`mtp.*` in Nemotron-H) serve speculative decoding, which transformers does not
    # load either; they are skipped until the engine grows speculative decoding.
    patterns.append(r"^mtp\.")
    # DeepSeek / GLM checkpoints append theirs as extra decoder layers after the last real one.
    num_mtp = getattr(config, "num_nextn_predict_layers", 0)
    if num_mtp and config.model_type in ("deepseek_v32", "glm_moe_dsa"):
        first = config.num_hidden_layers
        patterns.append(rf"^layers\.({'|'.join(str(first + i) for i in range(num_mtp))})\.")
    return tuple(patterns)

