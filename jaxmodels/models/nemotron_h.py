"""Nemotron-H hybrid (NVIDIA): a stack of single-mixer blocks `x + mixer(RMSNorm(x))`.

Mixers: Mamba2 (`mamba`), GQA attention without RoPE (`attention`), relu² MLP (`mlp`), relu² MoE (`moe`).
One forward serves every mode (see jaxmodels.step_context): full sequences, or the engine's packed extend and decode
steps over paged KV caches and Mamba state pools (one cache per attention / Mamba layer).
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
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.models.causal_lm import CausalLM
from jaxmodels.precision import precision_scope
from jaxmodels.step_context import StepContext

CACHED_KINDS = ("attention", "mamba")


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

    def __call__(self, hidden: jax.Array, step: StepContext | None = None, cache=None):
        """-> (hidden, the layer's cache: None without a step or for MLP / MoE blocks)."""
        x = self.norm(hidden)
        if step is not None and self.kind in CACHED_KINDS:
            x, cache = self.mixer(x, step, cache)
        elif step is not None:
            x = self.mixer(x, step.dp_axis)  # MLP / MoE: their weights may be split over the step's dp groups
        else:
            x = self.mixer(x)
        return hidden + x, cache


class NemotronHForCausalLM(CausalLM):
    HF_BASE_PREFIX = "backbone."  # NVIDIA's published checkpoints; transformers writes the same on save
    EMBEDDING = "embeddings"

    def __init__(self, config: NemotronHConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = self._init_model(config, dtype, matmul_precision, rngs)
        self.layers = nnx.List([NemotronHBlock(config, kind, rngs=rngs, dtype=dtype) for kind in config.layer_types])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        self._init_head(rngs)

    def cache_shapes(self, sizes, *, mamba_ssm_cache_dtype=None) -> list:
        """Per layer, the ShapeDtypeStructs of its serving cache (None for MLP / MoE blocks); `sizes` gives
        num_pages, page_size and num_slots (engine.cache.PoolSizes)."""
        ssm_dtype = jnp.dtype(mamba_ssm_cache_dtype or self.config.mamba_ssm_cache_dtype)
        shapes = []
        for block in self.layers:
            if block.kind == "attention":
                shapes.append(block.mixer.cache_shape(sizes.num_pages, sizes.page_size, self.dtype))
            elif block.kind == "mamba":
                shapes.append(block.mixer.cache_shape(sizes.num_slots, self.dtype, ssm_dtype))
            else:
                shapes.append(None)
        return shapes

    def __call__(self, input_ids: jax.Array, step: StepContext | None = None, caches: list | None = None):
        """Without a step: int32[B, T] -> float32[B, T, V], the full causal forward with no cache.

        With one: the step's packed int32[T] over `caches` (as `cache_shapes` lays them out) ->
        (logits float32[R, V] of the step's `logit_rows`, updated caches).
        """
        with precision_scope(self.matmul_precision):
            hidden = self.embed(input_ids)
            caches = self._layer_caches(caches)
            for i, block in enumerate(self.layers):
                hidden, caches[i] = block(hidden, step, caches[i])
            return self._output(self.norm_f(hidden), step, caches)
