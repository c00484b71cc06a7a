"""Tiny random transformers checkpoints for parity tests (torch CPU, float32)."""

import torch

# Shapes chosen to hit the awkward cases: several Mamba groups, a Mamba head dim that is not a power of two, a
# chunk size small enough for prompts to span several chunks, GQA, grouped routing with a shared expert.
NEMOTRON_H_BASE = dict(
    vocab_size=97, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
    intermediate_size=40, mamba_num_heads=6, mamba_head_dim=6, ssm_state_size=8, n_groups=3, conv_kernel=4,
    chunk_size=8, layer_norm_epsilon=1e-5, initializer_range=0.1, tie_word_embeddings=False,
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
                # Spread dt so that some heads sit below time_step_min and exercise the clamp.
                layer.mixer.dt_bias.copy_(torch.randn_like(layer.mixer.dt_bias) * 2 - 3)
    return model


def save(model, directory, **kwargs):
    model.save_pretrained(directory, **kwargs)
    return directory


def logits_of(model, input_ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(input_ids)).logits.float()
