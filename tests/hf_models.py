"""Tiny random transformers checkpoints for parity tests (torch CPU, float32)."""

import os

import torch
from safetensors.torch import load_file, save_file

# Shapes chosen to hit the awkward cases: several Mamba groups, a Mamba head dim that is not a power of two, a
# chunk size small enough for prompts to span several chunks, GQA, grouped routing with a shared expert.
NEMOTRON_H_BASE = dict(
    vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    intermediate_size=40, mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=8, n_groups=3, conv_kernel=4,
    chunk_size=8, layer_norm_epsilon=1e-5, initializer_range=0.1, tie_word_embeddings=False,
    # The prompt path's dt clamp, written out: transformers >= 5.25 takes it from here (default (0, inf)), earlier
    # versions clamped at time_step_min (0.001) whatever this said, so the tiny models mean the same to both.
    time_step_limit=(0.001, float("inf")),
)

NEMOTRON_H_VARIANTS = {
    "dense": dict(hybrid_override_pattern="M*-M-M"),
    "moe": dict(hybrid_override_pattern="ME*EM", n_routed_experts=8, num_experts_per_tok=3,
                moe_intermediate_size=20, moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, norm_topk_prob=True),
    "latent_moe": dict(hybrid_override_pattern="MEM*E", n_routed_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=16, moe_shared_expert_intermediate_size=20, moe_latent_size=24,
                       n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False),
}


def make_nemotron_h(variant: str, seed: int = 0, **overrides):
    """A random `NemotronHForCausalLM` in eval mode, with random router correction biases.

    The biases are drawn so that selection-with-bias really differs from selection by the unbiased scores.
    """
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{**NEMOTRON_H_BASE, **NEMOTRON_H_VARIANTS[variant], **overrides})
    model = NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
        for layer in model.model.layers:
            if hasattr(layer.mixer, "dt_bias"):
                # Spread dt so that some heads sit below the clamp's floor (time_step_limit) and exercise it.
                layer.mixer.dt_bias.copy_(torch.randn_like(layer.mixer.dt_bias) * 2 - 3)
    return model


def save(model, directory, **kwargs):
    model.save_pretrained(directory, **kwargs)
    return directory


def append_tensors(directory, tensors: dict) -> None:
    """Add `tensors` ({checkpoint name: torch tensor}) to the `model.safetensors` of a saved checkpoint: the MTP
    layers, which transformers neither builds nor saves."""
    path = os.path.join(directory, "model.safetensors")
    saved = load_file(path)
    clashes = sorted(saved.keys() & tensors.keys())
    assert not clashes, f"{path} already holds {clashes}"
    saved.update({name: tensor.detach().clone().contiguous() for name, tensor in tensors.items()})
    save_file(saved, path, metadata={"format": "pt"})


def logits_of(model, input_ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(input_ids)).logits.float()


# DSA models (DeepSeek-V3.2, GLM-5). Index heads are many enough (16) that an all-heads-negative score of exactly 0,
# which would tie, is rare; the dims are distinct so a swapped split shows as a shape error.
DSA_BASE = dict(
    vocab_size=101, hidden_size=48, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=10,
    qk_rope_head_dim=8, v_head_dim=12, index_n_heads=16, index_head_dim=16, index_topk=6, first_k_dense_replace=1,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
    routed_scaling_factor=2.5, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)

# YaRN with mscale != mscale_all_dim, so that both the cos/sin factor and the softmax-scale correction are not 1.
DSA_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16,
                beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.7)

DSA_VARIANTS = {
    "deepseek_v32": dict(),
    "deepseek_v32_yarn": dict(rope_parameters=DSA_YARN, max_position_embeddings=128, n_group=1, topk_group=1,
                              norm_topk_prob=False, routed_scaling_factor=1.5),
    # GLM-5 with a shared-indexer layer (layer 2 reuses layer 1's top-k).
    "glm_moe_dsa": dict(indexer_types=["full", "full", "shared"], n_group=2, topk_group=1, num_experts_per_tok=2),
}

# `config.json` dicts of one tiny model per family (MoE Nemotron-H, DeepSeek-V3.2), for tests that build our models
# from a config alone, with no transformers model or checkpoint.
TINY_CONFIGS = {
    "nemotron_h": {"model_type": "nemotron_h", **NEMOTRON_H_BASE, **NEMOTRON_H_VARIANTS["moe"]},
    "deepseek_v32": {"model_type": "deepseek_v32", **DSA_BASE},
}


def build_from_config(raw: dict, dtype="float32", seed: int = 0):
    """Our model for a `config.json` dict (e.g. one of TINY_CONFIGS, with overrides), random weights: no
    transformers model or checkpoint involved."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxmodels.families import load_config, model_class

    config = load_config(raw)
    return model_class(config)(config, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))


def make_dsa(variant: str, seed: int = 0, **overrides):
    """A random DeepSeek-V3.2 or GLM-5 model in eval mode, its norms and router biases perturbed
    (`perturb_norms_and_router_biases`)."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    glm = variant.startswith("glm")
    config_cls, model_cls = (GlmMoeDsaConfig, GlmMoeDsaForCausalLM) if glm else (DeepseekV32Config,
                                                                                 DeepseekV32ForCausalLM)
    torch.manual_seed(seed)
    config = config_cls(**{**DSA_BASE, **DSA_VARIANTS[variant], **overrides})
    model = model_cls(config).eval()
    perturb_norms_and_router_biases(model)
    return model


def perturb_norms_and_router_biases(model) -> None:
    """Norm weights drawn away from 1 (and norm biases away from 0), so that a norm applied to the wrong tensor (or
    not at all) shows; router correction biases drawn so that selection with bias differs from selection without."""
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn_like(tensor) * 0.05)
            elif name.endswith(("norm.weight", "norm_f.weight")):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif name.endswith("k_norm.bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
