"""DSA models: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`).

A stack of pre-norm decoder layers `x += MLA(RMSNorm(x)); x += MLP(RMSNorm(x))`. MLA attends only to the keys its
lightning indexer selects (GLM-5's `shared` layers reuse the previous layer's selection); the MLP is a SwiGLU for
the first `first_k_dense_replace` layers and a DeepSeek MoE (grouped sigmoid routing, shared expert) after.
Parameter names mirror transformers' (without the `model.` prefix), so the bridge maps checkpoints by rule.
Multi-token-prediction layers (`layers.{num_hidden_layers}...` in published checkpoints) are not built.

Forward structure, for a serving step with caches: the model computes one RoPE table for the positions, then per
layer `MLAttention.project` (q parts, the latent cache row, the q latent), `LightningIndexer.keys` (the index-key
cache row) and `.queries`, `.select` over the index-key cache, and `MLAttention.absorb_query` /
`.attend_absorbed` / `.output_from_latent` over the latent cache. `__call__` chains these over whole sequences,
using the batch's own rows as the caches.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.configs.deepseek_v32 import DeepseekV32Config
from jaxmodels.layers.linear import linear, lm_logits
from jaxmodels.layers.mla import MLAttention
from jaxmodels.layers.mlp import GatedMLP
from jaxmodels.layers.moe import MoE
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.layers.rope import rope_cos_sin
from jaxmodels.precision import matmul_precision_for, precision_scope


def build_mlp(config: DeepseekV32Config, kind: str, *, rngs: nnx.Rngs, dtype) -> nnx.Module:
    if kind == "dense":
        return GatedMLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype)
    shared = GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, rngs=rngs,
                      dtype=dtype)
    # transformers' DeepSeek-V3.2 / GLM-5 routers mask the experts of unchosen groups with -inf (the MoE default).
    return MoE(config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
               expert_intermediate=config.moe_intermediate_size, shared_intermediate=0, n_group=config.n_group,
               topk_group=config.topk_group, norm_topk_prob=config.norm_topk_prob,
               routed_scaling_factor=config.routed_scaling_factor, rngs=rngs, dtype=dtype, activation="silu",
               gated=True, shared_expert=shared)


class DeepseekV32DecoderLayer(nnx.Module):
    def __init__(self, config: DeepseekV32Config, index: int, *, rngs: nnx.Rngs, dtype):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)
        self.self_attn = MLAttention(config, with_indexer=config.layer_indexer_types[index] == "full", rngs=rngs,
                                     dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                scale_in_float32=False)
        self.mlp = build_mlp(config, config.mlp_layer_types[index], rngs=rngs, dtype=dtype)

    def __call__(self, hidden, cos, sin, indices=None, *, mla_path: str = "absorbed"):
        attn, indices = self.self_attn(self.input_layernorm(hidden), cos, sin, indices, path=mla_path)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), indices


class DeepseekV32ForCausalLM(nnx.Module):
    HF_BASE_PREFIX = "model."  # transformers' layout, and DeepSeek's / Z.ai's published checkpoints

    def __init__(self, config: DeepseekV32Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.matmul_precision = matmul_precision_for(self.dtype, matmul_precision)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      rngs=rngs)
        self.layers = nnx.List([DeepseekV32DecoderLayer(config, i, rngs=rngs, dtype=dtype)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)
        if not config.tie_word_embeddings:
            self.lm_head = linear(config.hidden_size, config.vocab_size, rngs=rngs, dtype=dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        return lm_logits(hidden, self.embed_tokens, None if self.config.tie_word_embeddings else self.lm_head)

    def __call__(self, input_ids: jax.Array, *, mla_path: str = "absorbed") -> jax.Array:
        """int32[B, T] -> float32[B, T, V]: full causal forward, no cache.

        `mla_path` picks how attention runs ("absorbed": the sparse latent kernel decoding uses; "expanded": per-head
        keys and values, as prefill would); both attend to the same indexer-selected keys.
        """
        input_ids = jnp.asarray(input_ids, jnp.int32)
        with precision_scope(self.matmul_precision):
            hidden = self.embed_tokens(input_ids)
            cos, sin = rope_cos_sin(jnp.arange(input_ids.shape[1]), self.config.rope)
            indices = None
            for layer in self.layers:
                hidden, indices = layer(hidden, cos, sin, indices, mla_path=mla_path)
            return self.logits(self.norm(hidden))


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: the same stack; its config selects the interleaved indexer RoPE and the shared-indexer layers."""
