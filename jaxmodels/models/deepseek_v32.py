"""DSA models: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`).

A stack of pre-norm decoder layers `x += MLA(RMSNorm(x)); x += MLP(RMSNorm(x))`. MLA attends only to the keys its
lightning indexer selects (GLM-5's `shared` layers reuse the previous layer's selection); the MLP is a SwiGLU for
the first `first_k_dense_replace` layers and a DeepSeek MoE (grouped sigmoid routing, shared expert) after.
Parameter names mirror transformers' (without the `model.` prefix), so the bridge maps checkpoints by rule.
Multi-token-prediction layers (`layers.{num_hidden_layers}...` in published checkpoints) are not built.

One forward serves every mode (see jaxmodels.step_context): whole causal sequences, using the batch's own rows as
the caches, or the engine's packed extend and decode steps over paged latent and index-key caches. With no recurrent
state, extend and decode are the same per-token computation; only which tokens' logits come back differs.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.configs.deepseek_v32 import DeepseekV32Config
from jaxmodels.layers.mla import MLAttention
from jaxmodels.layers.mlp import GatedMLP
from jaxmodels.layers.moe import MoE
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.layers.rope import rope_cos_sin
from jaxmodels.models.causal_lm import CausalLM
from jaxmodels.precision import precision_scope
from jaxmodels.step_context import StepContext


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

    def __call__(self, hidden, cos, sin, indices=None, *, step: StepContext | None = None, cache=None,
                 mla_path: str = "absorbed"):
        """-> (hidden, the top-k indices the next layer may share, the layer's cache: None without a step)."""
        x = self.input_layernorm(hidden)
        if step is None:
            attn, indices = self.self_attn(x, cos, sin, indices, path=mla_path)
        else:
            attn, indices, cache = self.self_attn(x, cos, sin, indices, step=step, cache=cache)
        hidden = hidden + attn
        dp_axis = step.dp_axis if step is not None else None
        return hidden + self.mlp(self.post_attention_layernorm(hidden), dp_axis), indices, cache


class DeepseekV32ForCausalLM(CausalLM):
    HF_BASE_PREFIX = "model."  # transformers' layout, and DeepSeek's / Z.ai's published checkpoints

    def __init__(self, config: DeepseekV32Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = self._init_model(config, dtype, matmul_precision, rngs)
        self.layers = nnx.List([DeepseekV32DecoderLayer(config, i, rngs=rngs, dtype=dtype)
                                for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)
        self._init_head(rngs)

    def cache_shapes(self, sizes, *, mamba_ssm_cache_dtype=None) -> list:
        """Per layer, the ShapeDtypeStructs of its paged caches (`sizes`: num_pages, page_size; see
        engine.cache.PoolSizes)."""
        if mamba_ssm_cache_dtype is not None:
            raise ValueError("mamba_ssm_cache_dtype applies to Nemotron-H models; DSA models have no Mamba state")
        return [layer.self_attn.cache_shape(sizes.num_pages, sizes.page_size, self.dtype) for layer in self.layers]

    def __call__(self, input_ids: jax.Array, step: StepContext | None = None, caches: list | None = None, *,
                 mla_path: str = "absorbed"):
        """Without a step: int32[B, T] -> float32[B, T, V], the full causal forward with no cache. `mla_path` picks
        how attention runs then ("absorbed": the sparse latent kernel the engine uses; "expanded": per-head keys and
        values); both attend to the same indexer-selected keys.

        With one: the step's packed int32[T] over `caches` (as `cache_shapes` lays them out) ->
        (logits float32[R, V] of the step's `logit_rows`, updated caches).
        """
        with precision_scope(self.matmul_precision):
            hidden = self.embed(input_ids)
            positions = jnp.arange(hidden.shape[1]) if step is None else step.positions
            cos, sin = rope_cos_sin(positions, self.config.rope)
            caches = self._layer_caches(caches)
            indices = None
            for i, layer in enumerate(self.layers):
                hidden, indices, caches[i] = layer(hidden, cos, sin, indices, step=step, cache=caches[i],
                                                   mla_path=mla_path)
            return self._output(self.norm(hidden), step, caches)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: the same stack; its config selects the interleaved indexer RoPE and the shared-indexer layers."""
