"""DSA models: DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) and GLM-5 (`GlmMoeDsaForCausalLM`).

A stack of pre-norm decoder layers `x += MLA(RMSNorm(x)); x += MLP(RMSNorm(x))`. MLA attends only to the keys its
lightning indexer selects (GLM-5's `shared` layers reuse the previous layer's selection); the MLP is a SwiGLU for
the first `first_k_dense_replace` layers and a DeepSeek MoE (grouped sigmoid routing, shared expert) after.
Parameter names mirror transformers' (without the `model.` prefix), so the bridge maps checkpoints by rule.

Multi-token prediction (see jaxmodels.layers.mtp), which transformers does not load: checkpoints store the
`num_nextn_predict_layers` MTP layers as decoder layers numbered on after the last one, `layers.{num_hidden_layers
+ i}.*` (MLA with its indexer, MoE, both layer norms), plus `enorm.weight`, `hnorm.weight`, `eh_proj.weight` [H, 2H]
and `shared_head.norm.weight` (the norm before the LM head). They also hold `embed_tokens.weight` and
`shared_head.head.weight`, which "share parameters" with the target's embedding and LM head (DeepSeek-V3's
README_WEIGHTS.md): we skip these copies and use the target's, as SGLang does. Layout read there and in vLLM's
`deepseek_mtp.py` and SGLang's `deepseek_nextn.py`. Our MTP layers live in `mtp_layers`, apart from the decoder
stack; the loader maps the names (`mtp_checkpoint_prefixes`).

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
from jaxmodels.layers.mtp import MTPInputFusion
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.layers.rope import rope_cos_sin
from jaxmodels.models.causal_lm import CausalLM
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
    def __init__(self, config: DeepseekV32Config, *, mlp_kind: str, with_indexer: bool, rngs: nnx.Rngs, dtype):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)
        self.self_attn = MLAttention(config, with_indexer=with_indexer, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                scale_in_float32=False)
        self.mlp = build_mlp(config, mlp_kind, rngs=rngs, dtype=dtype)

    def __call__(self, hidden, cos, sin, indices=None, *, step: StepContext | None = None, cache=None,
                 mla_path: str = "absorbed"):
        """-> (hidden, the top-k indices the next layer may share, the layer's cache: None without a step)."""
        hidden, x, indices, cache = self.deferred(hidden, None, cos, sin, indices, step=step, cache=cache,
                                                  mla_path=mla_path)
        return hidden + x, indices, cache

    def deferred(self, hidden, delta, cos, sin, indices=None, *, step: StepContext | None = None, cache=None,
                 mla_path: str = "absorbed"):
        """The layer with its last residual add deferred: hidden + delta (the previous layer's MLP output, if any)
        feeds the input norm in one kernel, as the attention output and the post-attention norm do
        (RMSNorm.add_and_norm) -> (the residual stream before the MLP's add, the MLP output, indices, cache)."""
        hidden, x = self.input_layernorm.add_and_norm(hidden, delta)
        if step is None:
            attn, indices = self.self_attn(x, cos, sin, indices, path=mla_path)
        else:
            attn, indices, cache = self.self_attn(x, cos, sin, indices, step=step, cache=cache)
        hidden, x = self.post_attention_layernorm.add_and_norm(hidden, attn)
        dp_axis = step.dp_axis if step is not None else None
        return hidden, self.mlp(x, dp_axis), indices, cache


class SharedHead(nnx.Module):
    """An MTP layer's output: the norm before the LM head. (Its `head` copies the target's LM head: not built.)"""

    def __init__(self, config: DeepseekV32Config, *, dtype):
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)


class DeepseekV32MTPLayer(MTPInputFusion, DeepseekV32DecoderLayer):
    """A decoder layer that drafts the token after next: fused inputs, the layer, `shared_head.norm`. It always has
    its own indexer: no layer before it in its stack has a top-k to share."""

    def __init__(self, config: DeepseekV32Config, *, rngs: nnx.Rngs, dtype):
        super().__init__(config, mlp_kind=config.mtp_mlp_layer_type, with_indexer=True, rngs=rngs, dtype=dtype)
        self.init_input_fusion(config.hidden_size, config.rms_norm_eps, rngs=rngs, dtype=dtype,
                               scale_in_float32=False)
        self.shared_head = SharedHead(config, dtype=dtype)

    def draft(self, hidden, token_embeddings, cos, sin, *, mla_path: str = "absorbed", step=None, cache=None):
        """Hidden states and next-token embeddings -> (the normed output, the layer's cache: None without a step),
        over whole sequences ([B, T, H]) or a step's packed tokens ([T, H])."""
        hidden, _, cache = self(self.fuse_inputs(token_embeddings, hidden), cos, sin, step=step, cache=cache,
                                mla_path=mla_path)
        return self.shared_head.norm(hidden), cache


class DeepseekV32ForCausalLM(CausalLM):
    HF_BASE_PREFIX = "model."  # transformers' layout, and DeepSeek's / Z.ai's published checkpoints
    MTP_COPIES_OF_TARGET = ("embed_tokens.weight", "shared_head.head.weight")
    # DeepSeek's and Z.ai's FP8 checkpoints keep these in bf16 (see jaxmodels.quantization).
    FP8_UNQUANTIZED = ("lm_head", "*.indexer.weights_proj", "*.eh_proj")

    def __init__(self, config: DeepseekV32Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = self._init_model(config, dtype, matmul_precision, rngs)
        self.layers = nnx.List([
            DeepseekV32DecoderLayer(config, mlp_kind=config.mlp_layer_types[i],
                                    with_indexer=config.layer_indexer_types[i] == "full", rngs=rngs, dtype=dtype)
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, scale_in_float32=False)
        self._init_head(rngs)
        self.mtp_layers = nnx.List([DeepseekV32MTPLayer(config, rngs=rngs, dtype=dtype)
                                    for _ in range(config.num_nextn_predict_layers)])

    @classmethod
    def mtp_checkpoint_prefixes(cls, config: DeepseekV32Config) -> dict[str, str]:
        first = config.num_hidden_layers
        return {f"mtp_layers.{i}.": f"layers.{first + i}." for i in range(config.num_nextn_predict_layers)}

    def cache_shapes(self, sizes, *, mamba_ssm_cache_dtype=None) -> list:
        """Per layer, the ShapeDtypeStructs of its paged caches (`sizes`: num_pages, page_size; see
        engine.cache.PoolSizes)."""
        if mamba_ssm_cache_dtype is not None:
            raise ValueError("mamba_ssm_cache_dtype applies to Nemotron-H models; DSA models have no Mamba state")
        return [layer.self_attn.cache_shape(sizes.num_pages, sizes.page_size, self.dtype) for layer in self.layers]

    def _hidden_states(self, input_ids: jax.Array, step: StepContext | None, caches: list | None, *,
                       mla_path: str = "absorbed"):
        """The forward (see CausalLM.__call__) up to the LM head: (final-normed hidden states, updated caches).

        Without a step, `mla_path` picks how attention runs ("absorbed": the sparse latent kernel the engine uses;
        "expanded": per-head keys and values); both attend to the same indexer-selected keys.
        """
        hidden = self.embed(input_ids)
        positions = jnp.arange(hidden.shape[1]) if step is None else step.positions
        cos, sin = rope_cos_sin(positions, self.config.rope)
        caches = self._layer_caches(caches)
        indices, delta = None, None
        for i, layer in enumerate(self.layers):
            hidden, delta, indices, caches[i] = layer.deferred(hidden, delta, cos, sin, indices, step=step,
                                                               cache=caches[i], mla_path=mla_path)
        return self.norm.add_and_norm(hidden, delta)[1], caches

    def mtp_cache_shapes(self, sizes) -> list:
        """Per MTP layer, its paged caches' ShapeDtypeStructs."""
        return [layer.self_attn.cache_shape(sizes.num_pages, sizes.page_size, self.dtype) for layer in self.mtp_layers]

    def _mtp_hidden(self, index: int, hidden: jax.Array, token_embeddings: jax.Array, *, step=None, caches=None,
                    mla_path: str = "absorbed"):
        positions = jnp.arange(hidden.shape[1]) if step is None else step.positions
        cos, sin = rope_cos_sin(positions, self.config.rope)
        if step is None:
            return self.mtp_layers[index].draft(hidden, token_embeddings, cos, sin, mla_path=mla_path)[0]
        caches = list(caches)
        hidden, caches[index] = self.mtp_layers[index].draft(hidden, token_embeddings, cos, sin, step=step,
                                                             cache=caches[index])
        return hidden, caches


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: the same stack; its config selects the interleaved indexer RoPE and the shared-indexer layers."""
