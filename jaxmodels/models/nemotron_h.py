"""Nemotron-H hybrid (NVIDIA): a stack of single-mixer blocks `x + mixer(RMSNorm(x))`.

Mixers: Mamba2 (`mamba`), GQA attention without RoPE (`attention`), relu² MLP (`mlp`), relu² MoE (`moe`).
Parameter names mirror transformers' `NemotronHForCausalLM` (without the `backbone.`/`model.` prefix), so the
bridge maps checkpoints by rule rather than by table.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.configs import NemotronHConfig
from jaxmodels.layers.attention import GQAAttention
from jaxmodels.layers.mamba2 import Mamba2Mixer
from jaxmodels.layers.mlp import MLP
from jaxmodels.layers.moe import MoE
from jaxmodels.layers.linear import linear, lm_logits
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.precision import matmul_precision_for, precision_scope


def build_mixer(config: NemotronHConfig, kind: str, *, rngs: nnx.Rngs, dtype) -> nnx.Module:
    if kind == "mamba":
        return Mamba2Mixer(
            hidden_size=config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size, time_step_min=config.time_step_min, eps=config.layer_norm_epsilon,
            rngs=rngs, dtype=dtype, conv_bias=config.use_conv_bias, proj_bias=config.mamba_proj_bias)
    if kind == "attention":
        # transformers' NemotronH builds a plain causal mask and ignores `sliding_window`; so do we, for parity.
        return GQAAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                            config.head_dim, rngs=rngs, dtype=dtype)
    if kind == "mlp":
        return MLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype, bias=config.mlp_bias)
    if kind == "moe":
        return MoE(
            config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            expert_intermediate=config.moe_intermediate_size,
            shared_intermediate=config.moe_shared_expert_intermediate_size, n_group=config.n_group,
            topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor, rngs=rngs, dtype=dtype,
            latent_size=config.moe_latent_size)
    raise ValueError(f"unknown Nemotron-H layer kind {kind!r}")


class NemotronHBlock(nnx.Module):
    def __init__(self, config: NemotronHConfig, kind: str, *, rngs: nnx.Rngs, dtype):
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        self.mixer = build_mixer(config, kind, rngs=rngs, dtype=dtype)

    def __call__(self, hidden: jax.Array) -> jax.Array:
        return hidden + self.mixer(self.norm(hidden))


class NemotronHForCausalLM(nnx.Module):
    HF_BASE_PREFIX = "backbone."  # NVIDIA's published checkpoints; transformers writes the same on save

    def __init__(self, config: NemotronHConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.matmul_precision = matmul_precision_for(self.dtype, matmul_precision)
        self.embeddings = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                    rngs=rngs)
        self.layers = nnx.List([NemotronHBlock(config, kind, rngs=rngs, dtype=dtype) for kind in config.layer_types])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return lm_logits(hidden, self.embeddings, None if self.config.tie_word_embeddings else self.lm_head)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """int32[B,T] -> float32[B,T,V]: full causal forward, no cache."""
        with precision_scope(self.matmul_precision):
            hidden = self.embeddings(jnp.asarray(input_ids, jnp.int32))
            for block in self.layers:
                hidden = block(hidden)
            return self.logits(self.norm_f(hidden))
