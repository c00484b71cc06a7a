"""Hardware floors for the serving benchmark: the bytes a decode step must move and the FLOPs a prefill must do.

Decode is memory-bound: per step, the weights read once (for MoE only the experts some token of the batch picked),
every request's KV / latent / index-key cache up to its length, and the Mamba states read and written once.
Prefill is compute-bound: 2 FLOPs per active parameter per token, plus causal attention. Rates are the H200's
measured ceilings (DESIGN.md): 4.25 TB/s device-to-device copy, 810 TFLOP/s dense bf16.

An FP8 model (weights float8_e4m3fn with float32 scales) counts the bytes it holds: one per FP8 weight, four per
scale. Its FP8 GEMMs' FLOPs go at twice the bf16 rate, the tensor cores' FP8 rate (1979 vs 989 TFLOP/s on the data
sheet) applied to the measured bf16 ceiling.
"""

import dataclasses

import ml_dtypes
import numpy as np

COPY_BANDWIDTH = 4.25e12  # bytes/s, read + written
BF16_PEAK = 810e12  # FLOP/s
FP8_PEAK = 2 * BF16_PEAK
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")  # FP8 scales: bytes to read, no FLOPs


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    dense_weight_bytes: float  # everything read every decode step (no embedding table: only B rows are read)
    expert_bytes: float  # one routed expert of one MoE layer
    moe_layers: int
    num_experts: int
    experts_per_token: int
    active_params_per_token: float  # multiply-adds per token through the weights (k experts, not all)
    fp8_params_per_token: float  # the share of those whose weights are FP8
    head_params: float  # the LM head's, which a prefill runs for its last token only
    cache_bytes_per_token: float  # KV / latent / index keys written once and read by every later step
    state_bytes_per_request: float  # Mamba SSM + conv state, read and written once per decode step
    attention: str  # "gqa" or "dsa"
    attn_layers: int
    heads: int
    head_flops_dim: int  # per-head query-key plus probability-value width
    index_topk: int = 0
    indexer_flops_per_key: float = 0.0  # indexer multiply-adds per (query, key)
    dsa_rows_bytes: float = 0.0  # latent row read per selected key, all layers
    # One drafting pass of the MTP layers (none: 0): their weights but the routed experts, plus the LM head they share
    # with the target; their MoE layers; their caches and states, as the target's above.
    draft_weight_bytes: float = 0.0
    draft_moe_layers: int = 0
    draft_cache_bytes_per_token: float = 0.0
    draft_dsa_rows_bytes: float = 0.0
    draft_state_bytes_per_request: float = 0.0


def model_costs(config, params: dict, dtype, ssm_dtype=None) -> ModelCosts:
    """Costs of a model from its config and its {dotted path: array} params (its MTP layers' apart: `draft_*`, read
    by drafting passes only)."""
    from jaxmodels.families import model_class

    itemsize = np.dtype(dtype).itemsize
    mtp_prefixes = tuple(model_class(config).mtp_checkpoint_prefixes(config))  # the MTP layers' param paths
    sizes = {path: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for path, a in params.items()}
    nbytes_draft = {p: b for p, b in sizes.items() if p.startswith(mtp_prefixes)}
    nbytes = {p: b for p, b in sizes.items() if p not in nbytes_draft}
    params = {p: params[p] for p in nbytes}
    weights = {path: int(np.prod(a.shape)) for path, a in params.items() if not path.endswith(SCALE_SUFFIXES)}
    expert_paths = [p for p in params if ".experts." in p]
    embedding = sum(b for p, b in nbytes.items() if p.endswith("embedding"))
    expert_total = sum(nbytes[p] for p in expert_paths)
    dense = sum(nbytes.values()) - embedding - expert_total
    num_experts = getattr(config, "n_routed_experts", 0) or 0
    k = getattr(config, "num_experts_per_tok", 0) or 0
    moe_layers = len({p.split(".experts.")[0] for p in expert_paths})
    expert_bytes = expert_total / max(moe_layers * num_experts, 1)

    def active(paths) -> float:
        """Weights of `paths` one token multiplies by: all but embeddings, of the routed experts k of each layer's."""
        paths = [p for p in paths if not p.endswith("embedding")]
        experts = sum(weights[p] for p in paths if ".experts." in p)
        return sum(weights[p] for p in paths if ".experts." not in p) + k * experts / max(num_experts, 1)

    fp8 = active([p for p in weights if params[p].dtype == ml_dtypes.float8_e4m3fn])
    head_bytes = sum(b for p, b in nbytes.items() if p.startswith("lm_head."))
    draft_experts = [p for p in nbytes_draft if ".experts." in p]
    costs = dict(dense_weight_bytes=dense, expert_bytes=expert_bytes, moe_layers=moe_layers, num_experts=num_experts,
                 experts_per_token=k, active_params_per_token=active(weights), fp8_params_per_token=fp8,
                 head_params=sum(weights[p] for p in weights if p.startswith("lm_head.")),
                 draft_weight_bytes=(sum(b for p, b in nbytes_draft.items() if ".experts." not in p)
                                     + head_bytes) if nbytes_draft else 0.0,
                 draft_moe_layers=len({p.split(".experts.")[0] for p in draft_experts}))
    mtp_layers = getattr(config, "num_nextn_predict_layers", 0) or 0
    if config.model_type == "nemotron_h":
        ssm_itemsize = np.dtype(ssm_dtype or config.mamba_ssm_cache_dtype).itemsize
        mamba_state = (config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * ssm_itemsize
                       + config.conv_dim * (config.conv_kernel - 1) * itemsize)
        kv = 2 * config.num_key_value_heads * config.head_dim * itemsize
        kinds, draft_kinds = config.layer_types, config.mtp_layer_types * mtp_layers
        attn_layers = kinds.count("attention")
        return ModelCosts(**costs, cache_bytes_per_token=attn_layers * kv,
                          state_bytes_per_request=kinds.count("mamba") * mamba_state, attention="gqa",
                          attn_layers=attn_layers, heads=config.num_attention_heads, head_flops_dim=2 * config.head_dim,
                          draft_cache_bytes_per_token=draft_kinds.count("attention") * kv,
                          draft_state_bytes_per_request=draft_kinds.count("mamba") * mamba_state)
    layers = config.num_hidden_layers
    row = config.kv_lora_rank + config.qk_rope_head_dim
    indexers = sum(t == "full" for t in config.layer_indexer_types)
    key_bytes = 1 + 4 if config.indexer_numerics != "exact" else itemsize
    index_key = config.index_head_dim * key_bytes
    # Each MTP layer has a latent cache and an indexer of its own (models/deepseek_v32.DeepseekV32MTPLayer).
    return ModelCosts(**costs, cache_bytes_per_token=layers * row * itemsize + indexers * index_key,
                      state_bytes_per_request=0.0, attention="dsa",
                      attn_layers=layers, heads=config.num_attention_heads, head_flops_dim=row + config.kv_lora_rank,
                      index_topk=config.index_topk,
                      indexer_flops_per_key=indexers * config.index_n_heads * config.index_head_dim,
                      dsa_rows_bytes=layers * row * itemsize,
                      draft_cache_bytes_per_token=mtp_layers * (row * itemsize + index_key),
                      draft_dsa_rows_bytes=mtp_layers * row * itemsize)


def experts_touched(costs: ModelCosts, tokens: int) -> float:
    """Expected distinct experts per MoE layer that `tokens` tokens pick (uniform routing)."""
    if not costs.num_experts:
        return 0.0
    return costs.num_experts * (1 - (1 - costs.experts_per_token / costs.num_experts) ** tokens)


def _pass_bytes(costs: ModelCosts, weights: float, moe_layers: int, tokens: int, batch: int, context: float,
                cache_per_token: float, dsa_rows: float, states: float) -> float:
    """Bytes of one pass of `tokens` tokens from `batch` requests at mean length `context` through layers whose
    weights but routed experts are `weights`: the experts the tokens pick, and each request's cache and states once
    (its tokens' reads of one cache coincide)."""
    weights += moe_layers * experts_touched(costs, tokens) * costs.expert_bytes
    if costs.attention == "dsa":
        # Every index key is scored, but only the top-k latent rows are read.
        per_request = (cache_per_token - dsa_rows) * context + dsa_rows * min(context, costs.index_topk)
    else:
        per_request = cache_per_token * context
    return weights + batch * (per_request + 2 * states)


def decode_step_bytes(costs: ModelCosts, batch: int, context: float) -> float:
    """Bytes one decode step of `batch` requests at mean length `context` must move."""
    return _pass_bytes(costs, costs.dense_weight_bytes, costs.moe_layers, batch, batch, context,
                       costs.cache_bytes_per_token, costs.dsa_rows_bytes, costs.state_bytes_per_request)


def verify_step_bytes(costs: ModelCosts, batch: int, k: int, context: float) -> float:
    """Bytes one speculative verify step must move: the target over k + 1 tokens a request (the last accepted
    token and k drafts), each request's cache and states read once and its states written once."""
    return _pass_bytes(costs, costs.dense_weight_bytes, costs.moe_layers, batch * (k + 1), batch, context,
                       costs.cache_bytes_per_token, costs.dsa_rows_bytes, costs.state_bytes_per_request)


def draft_step_bytes(costs: ModelCosts, batch: int, context: float) -> float:
    """Bytes one drafting pass of `batch` requests must move: the MTP layers and the LM head."""
    return _pass_bytes(costs, costs.draft_weight_bytes, costs.draft_moe_layers, batch, batch, context,
                       costs.draft_cache_bytes_per_token, costs.draft_dsa_rows_bytes,
                       costs.draft_state_bytes_per_request)


def expected_tokens(k: int, per_draft: float) -> float:
    """Tokens a verify step emits per request with k drafts, each standing with chance `per_draft` once those before
    it stood: the target's own token plus the standing prefix of the drafts, 1 + a + ... + a^k."""
    return sum(per_draft ** i for i in range(k + 1))


def speculative_bound(costs: ModelCosts, batch: int, k: int, per_draft: float, context: float) -> float:
    """The most speculative decoding can gain over plain decode where both move only their floor's bytes: tokens per
    cycle over the cycle's bytes (a verify step and k drafting passes), against a decode step's one token."""
    cycle = verify_step_bytes(costs, batch, k, context) + k * draft_step_bytes(costs, batch, context)
    return expected_tokens(k, per_draft) * decode_step_bytes(costs, batch, context) / cycle


def decode_floor_s(costs: ModelCosts, batch: int, context: float) -> float:
    return decode_step_bytes(costs, batch, context) / COPY_BANDWIDTH


def prefill_flops(costs: ModelCosts, tokens: int) -> float:
    """FLOPs of one causal prompt of `tokens` tokens (logits of its last token only)."""
    positions = np.arange(1, tokens + 1, dtype=np.float64)
    if costs.attention == "dsa":
        attended = np.minimum(positions, costs.index_topk).sum()
        attention = 2 * costs.attn_layers * costs.heads * costs.head_flops_dim * attended \
            + 2 * costs.indexer_flops_per_key * positions.sum()
    else:
        attention = 2 * costs.attn_layers * costs.heads * costs.head_flops_dim * positions.sum()
    return 2 * (costs.active_params_per_token - costs.head_params) * tokens + 2 * costs.head_params + attention


def prefill_floor_s(costs: ModelCosts, tokens: int) -> float:
    """The prefill's FLOPs at the bf16 rate, those through FP8 weights (the LM head never is) at the FP8 rate."""
    fp8 = 2 * costs.fp8_params_per_token * tokens
    return (prefill_flops(costs, tokens) - fp8) / BF16_PEAK + fp8 / FP8_PEAK
