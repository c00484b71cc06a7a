"""Nemotron-H hybrid (NVIDIA): a stack of single-mixer blocks `x + mixer(RMSNorm(x))`.

Mixers: Mamba2 (`mamba`), GQA attention without RoPE (`attention`), relu² MLP (`mlp`), relu² MoE (`moe`).
One forward serves every mode (see jaxmodels.step_context): full sequences, or the engine's packed extend and decode
steps over paged KV caches and Mamba state pools (one cache per attention / Mamba layer).
Parameter names mirror transformers' `NemotronHForCausalLM` (without the `backbone.`/`model.` prefix), so the
bridge maps checkpoints by rule rather than by table.

Multi-token prediction (see jaxmodels.layers.mtp), which transformers does not load. Layout read in vLLM's and
SGLang's `nemotron_h_mtp.py` (and Megatron-LM's `multi_token_prediction.py`, which trains these layers): each of the
`num_nextn_predict_layers` MTP layers is a run of ordinary blocks of the kinds `mtp_layers_block_type` lists
(legacy: the `mtp_hybrid_override_pattern` string, e.g. "*E"), all stored flat at the checkpoint's top level as
`mtp.layers.{j}.norm.weight`, `mtp.layers.{j}.mixer.*`. The first block of each MTP layer also holds
`enorm.weight`, `hnorm.weight` and `eh_proj.weight` [H, 2H]; the last holds `final_layernorm.weight`. The MTP layers
share the target's embedding and LM head (the checkpoint has no copies).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmodels.configs import NemotronHConfig
from jaxmodels.layers.attention import GQAAttention
from jaxmodels.layers.mamba2 import Mamba2Mixer, MambaVerifyCache
from jaxmodels.layers.mlp import MLP
from jaxmodels.layers.moe import MoE
from jaxmodels.layers.mtp import MTPInputFusion
from jaxmodels.layers.norms import RMSNorm
from jaxmodels.models.causal_lm import CausalLM
from jaxmodels.step_context import StepContext

CACHED_KINDS = ("attention", "mamba")


def build_mixer(config: NemotronHConfig, kind: str, *, rngs: nnx.Rngs, dtype) -> nnx.Module:
    if kind == "mamba":
        return Mamba2Mixer(
            hidden_size=config.hidden_size, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size, n_groups=config.n_groups, conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size, dt_limit=config.time_step_limit, eps=config.layer_norm_epsilon,
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
        hidden, x, cache = self.deferred(hidden, None, step, cache)
        return hidden + x, cache

    def deferred(self, hidden: jax.Array, delta: jax.Array | None, step: StepContext | None = None, cache=None):
        """The block with the residual adds deferred: hidden + delta (the previous block's output, if any) feeds
        this block's norm in one kernel (RMSNorm.add_and_norm) -> (hidden + delta, this block's output, cache);
        the next block, or the final norm, adds the output."""
        hidden, x = self.norm.add_and_norm(hidden, delta)
        if step is not None and self.kind in CACHED_KINDS:
            x, cache = self.mixer(x, step, cache)
        elif step is not None:
            x = self.mixer(x, step.dp_axis)  # MLP / MoE: their weights may be split over the step's dp groups
        else:
            x = self.mixer(x)
        return hidden, x, cache


class NemotronHMTPBlock(MTPInputFusion, NemotronHBlock):
    """A block of an MTP layer. The layer's first block also fuses the layer's inputs, its last ends with
    `final_layernorm`: the checkpoint keeps those weights on these blocks."""

    def __init__(self, config: NemotronHConfig, kind: str, *, opens_layer: bool, closes_layer: bool,
                 rngs: nnx.Rngs, dtype):
        super().__init__(config, kind, rngs=rngs, dtype=dtype)
        if opens_layer:
            self.init_input_fusion(config.hidden_size, config.layer_norm_epsilon, rngs=rngs, dtype=dtype,
                                   scale_in_float32=True)
        if closes_layer:
            self.final_layernorm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)


class NemotronHMTP(nnx.Module):
    """The MTP layers, their blocks in one flat list as checkpoints number them (`mtp.layers.{j}`)."""

    def __init__(self, config: NemotronHConfig, *, rngs: nnx.Rngs, dtype):
        kinds = config.mtp_layer_types if config.num_nextn_predict_layers else ()
        self.blocks_per_layer = len(kinds)
        self.layers = nnx.List([
            NemotronHMTPBlock(config, kind, opens_layer=j == 0, closes_layer=j == len(kinds) - 1, rngs=rngs,
                              dtype=dtype)
            for _ in range(config.num_nextn_predict_layers) for j, kind in enumerate(kinds)])

    def __call__(self, index: int, hidden: jax.Array, token_embeddings: jax.Array, step: StepContext | None = None,
                 caches: list | None = None):
        """MTP layer `index`: hidden states and next-token embeddings -> its normed output, over whole sequences
        ([B, T, H]) or a step's packed tokens ([T, H]; then -> (output, caches), with caches[j] the cache of block j
        of the flat list, None for blocks without one)."""
        first = index * self.blocks_per_layer
        blocks = self.layers[first : first + self.blocks_per_layer]
        caches = list(caches) if caches is not None else [None] * len(self.layers)
        hidden = blocks[0].fuse_inputs(token_embeddings, hidden)
        for j, block in enumerate(blocks, start=first):
            hidden, caches[j] = block(hidden, step, caches[j])
        hidden = blocks[-1].final_layernorm(hidden)
        return hidden if step is None else (hidden, caches)


class NemotronHForCausalLM(CausalLM):
    HF_BASE_PREFIX = "backbone."  # NVIDIA's published checkpoints; transformers writes the same on save
    EMBEDDING = "embeddings"

    def __init__(self, config: NemotronHConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 matmul_precision: str | None = None):
        rngs = self._init_model(config, dtype, matmul_precision, rngs)
        self.layers = nnx.List([NemotronHBlock(config, kind, rngs=rngs, dtype=dtype) for kind in config.layer_types])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        self._init_head(rngs)
        self.mtp = NemotronHMTP(config, rngs=rngs, dtype=dtype)

    @classmethod
    def mtp_checkpoint_prefixes(cls, config: NemotronHConfig) -> dict[str, str]:
        return {"mtp.": "mtp."} if config.num_nextn_predict_layers else {}

    def cache_shapes(self, sizes, *, mamba_ssm_cache_dtype=None) -> list:
        """Per layer, the ShapeDtypeStructs of its serving cache (None for MLP / MoE blocks); `sizes` gives
        num_pages, page_size and state_slots (engine.cache.PoolSizes)."""
        ssm_dtype = jnp.dtype(mamba_ssm_cache_dtype or self.config.mamba_ssm_cache_dtype)
        shapes = []
        for block in self.layers:
            if block.kind == "attention":
                shapes.append(block.mixer.cache_shape(sizes.num_pages, sizes.page_size, self.dtype))
            elif block.kind == "mamba":
                shapes.append(block.mixer.cache_shape(sizes.state_slots, self.dtype, ssm_dtype))
            else:
                shapes.append(None)
        return shapes

    def mtp_cache_shapes(self, sizes) -> list:
        """Per block of the MTP layers (`mtp.layers`), its serving cache's ShapeDtypeStructs (None for MoE / MLP)."""
        return [block.mixer.cache_shape(sizes.num_pages, sizes.page_size, self.dtype) if block.kind == "attention"
                else None for block in self.mtp.layers]

    def commit_verified(self, caches: list, step: StepContext, accepted: jax.Array) -> list:
        caches = list(caches)
        for i, block in enumerate(self.layers):
            if isinstance(caches[i], MambaVerifyCache):
                caches[i] = block.mixer.commit_verified(caches[i], step.slot_ids, accepted)
        return caches

    def _hidden_states(self, input_ids: jax.Array, step: StepContext | None, caches: list | None):
        """The forward (see CausalLM.__call__) up to the LM head: (final-normed hidden states, updated caches)."""
        hidden, delta = self.embed(input_ids), None
        caches = self._layer_caches(caches)
        for i, block in enumerate(self.layers):
            hidden, delta, caches[i] = block.deferred(hidden, delta, step, caches[i])
        return self.norm_f.add_and_norm(hidden, delta)[1], caches

    def _mtp_hidden(self, index: int, hidden: jax.Array, token_embeddings: jax.Array, step=None, caches=None):
        return self.mtp(index, hidden, token_embeddings, step, caches)
