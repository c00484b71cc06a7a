"""Config of Nemotron-H hybrids (`model_type: nemotron_h`)."""

import dataclasses
import math

from jaxmodels.configs.base import ConfigError, eos_token_ids, pop_alias, require_divisible, require_positive
from jaxmodels.configs.quantization import Fp8Config, fp8_config_from_hf

# Legacy pattern letters -> canonical `layers_block_type` names (transformers' own mapping).
PATTERN_LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# Canonical HF names -> our short layer kinds.
BLOCK_TYPE_NAMES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # each one of "mamba", "attention", "mlp", "moe"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mlp_bias: bool = False
    # dt's clamp in the prompt (chunked) path, as transformers (>= 5.25) and NVIDIA's reference code apply it:
    # `time_step_limit` from the config, default (0, inf). (`time_step_min` only sets dt_bias's initialization; until
    # 5.25 transformers clamped at it instead.)
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    # MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_shared_experts: int = 1
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    mamba_ssm_cache_dtype: str = "float32"
    eos_token_id: tuple[int, ...] = ()
    # Multi-token prediction: num_nextn_predict_layers MTP layers, each a run of blocks of these kinds.
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    quantization: Fp8Config | None = None  # how an FP8 checkpoint stores its weights (None: unquantized)

    model_type = "nemotron_h"

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def block_kinds(self) -> set[str]:
        """The kinds of every block the model builds, its MTP layers' included."""
        return set(self.layer_types) | set(self.mtp_layer_types if self.num_nextn_predict_layers else ())

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @classmethod
    def from_hf(cls, raw: dict) -> "NemotronHConfig":
        # Like transformers, the listed kinds or the pattern win over a stale num_hidden_layers.
        layer_types = _layer_kinds(raw, ("layers_block_type", "layer_types"), "hybrid_override_pattern")
        num_mtp_layers = raw.get("num_nextn_predict_layers", 0) or 0
        # transformers writes its default `mtp_layers_block_type` into every config: read it only where it counts.
        mtp_layer_types = (_layer_kinds(raw, ("mtp_layers_block_type",), "mtp_hybrid_override_pattern")
                           if num_mtp_layers > 0 else ())
        num_heads = raw.get("num_attention_heads", 32)
        eos = eos_token_ids(raw)
        values = dict(
            vocab_size=raw.get("vocab_size"),
            hidden_size=raw.get("hidden_size"),
            layer_types=layer_types,
            num_attention_heads=num_heads,
            num_key_value_heads=pop_alias(raw, "num_key_value_heads", default=num_heads),
            head_dim=pop_alias(raw, "head_dim", "attention_head_dim", default=128),
            intermediate_size=raw.get("intermediate_size", 21504),
            mamba_num_heads=raw.get("mamba_num_heads", 128),
            mamba_head_dim=raw.get("mamba_head_dim", 64),
            ssm_state_size=raw.get("ssm_state_size", 128),
            n_groups=pop_alias(raw, "n_groups", "mamba_n_groups", default=8),
            conv_kernel=pop_alias(raw, "conv_kernel", "mamba_d_conv", default=4),
            chunk_size=pop_alias(raw, "chunk_size", "mamba_chunk_size", default=128),
            use_conv_bias=pop_alias(raw, "use_conv_bias", "mamba_conv_bias", default=True),
            mamba_proj_bias=raw.get("mamba_proj_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            time_step_limit=tuple(float(x) for x in pop_alias(raw, "time_step_limit", "mamba_dt_limit",
                                                              default=(0.0, math.inf))),
            layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
            # transformers' NemotronH never ties its LM head to the embedding, whatever the flag says (its
            # `_tied_weights_keys` is empty): `lm_head.weight` is always its own tensor. Follow it, for parity.
            tie_word_embeddings=False,
            n_routed_experts=pop_alias(raw, "n_routed_experts", "num_local_experts", default=0),
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            moe_shared_expert_intermediate_size=raw.get("moe_shared_expert_intermediate_size", 0),
            n_shared_experts=raw.get("n_shared_experts", 1),
            moe_latent_size=raw.get("moe_latent_size"),
            n_group=raw.get("n_group", 1) or 1,
            topk_group=raw.get("topk_group", 1) or 1,
            norm_topk_prob=raw.get("norm_topk_prob", True),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            sliding_window=raw.get("sliding_window"),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            mamba_ssm_cache_dtype=raw.get("mamba_ssm_cache_dtype", "float32"),
            eos_token_id=eos,
            num_nextn_predict_layers=num_mtp_layers,
            mtp_layer_types=mtp_layer_types,
            quantization=fp8_config_from_hf(raw),
        )
        for name in ("vocab_size", "hidden_size"):
            if values[name] is None:
                raise ConfigError(name, "is required")
        for name in ("mlp_hidden_act", "mamba_hidden_act"):
            expected = "relu2" if name == "mlp_hidden_act" else "silu"
            if raw.get(name, expected) != expected:
                raise ConfigError(name, f"only {expected!r} is supported, got {raw[name]!r}")
        return cls(**values)

    def __post_init__(self):
        require_positive(self, "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        require_divisible(self, "num_attention_heads", "num_key_value_heads")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")
        if self.num_nextn_predict_layers and not self.mtp_layer_types:
            raise ConfigError("mtp_layers_block_type", "is required when num_nextn_predict_layers > 0")
        if self.num_nextn_predict_layers and "mamba" in self.mtp_layer_types:
            # No published checkpoint has one, and a recurrent draft layer would need state rolled back on rejection.
            raise ConfigError("mtp_layers_block_type", "Mamba blocks in MTP layers are not supported")
        if "mamba" in self.layer_types:
            require_positive(self, "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                             "chunk_size")
            require_divisible(self, "mamba_num_heads", "n_groups")
        if "mlp" in self.block_kinds:
            require_positive(self, "intermediate_size")
        if "moe" in self.block_kinds:
            require_positive(self, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "moe_shared_expert_intermediate_size", "n_group", "topk_group")
            require_divisible(self, "n_routed_experts", "n_group")
            if self.topk_group > self.n_group:
                raise ConfigError("topk_group", f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
            experts_in_groups = self.n_routed_experts // self.n_group * self.topk_group
            if self.num_experts_per_tok > experts_in_groups:
                raise ConfigError(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} exceeds the {experts_in_groups} experts of the selected groups",
                )
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ConfigError("n_group", "grouped routing scores each group by its top-2 experts: "
                                             "every group needs at least 2 experts")
            if self.n_shared_experts != 1:
                raise ConfigError("n_shared_experts", f"only 1 shared expert is supported, got {self.n_shared_experts}")
        if self.mamba_ssm_cache_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("mamba_ssm_cache_dtype", f"unsupported dtype {self.mamba_ssm_cache_dtype!r}")


def _layer_kinds(raw: dict, list_fields: tuple[str, ...], pattern_field: str) -> tuple[str, ...]:
    """Our layer kinds from the first of `list_fields` that is given (a list of HF block-type names), else from the
    legacy pattern string in `pattern_field`."""
    field = list_fields[0]
    listed = next((raw[name] for name in list_fields if raw.get(name)), None)
    if listed is not None:
        if not isinstance(listed, (list, tuple)):
            raise ConfigError(field, f"must be a list of strings, got {type(listed).__name__}")
        unknown = sorted({t for t in listed if t not in BLOCK_TYPE_NAMES})
        if unknown:
            raise ConfigError(field, f"unknown layer types {unknown}; expected names among {sorted(BLOCK_TYPE_NAMES)}")
        types = tuple(BLOCK_TYPE_NAMES[t] for t in listed)
    elif pattern_field in raw:
        pattern = raw[pattern_field]
        bad = sorted({c for c in pattern if c not in PATTERN_LETTERS})
        if bad:
            raise ConfigError(pattern_field,
                              f"unknown layer letters {bad} in {pattern!r}; expected letters among "
                              f"{sorted(PATTERN_LETTERS)} (M=mamba, *=attention, -=mlp, E=moe)")
        types = tuple(PATTERN_LETTERS[c] for c in pattern)
    else:
        raise ConfigError(field, f"neither {field} nor {pattern_field} is given")
    if not types:
        raise ConfigError(field, "lists no layers")
    return types
