"""Config of the DSA models: DeepSeek-V3.2 (`model_type: deepseek_v32`) and GLM-5 (`model_type: glm_moe_dsa`).

Both are MLA attention whose keys are picked per query by the lightning indexer, with a DeepSeek MoE after the first
`first_k_dense_replace` dense layers. They differ in two places, both recorded here so the model code has no
per-architecture branches: the indexer's RoPE layout (half-split for DeepSeek-V3.2, interleaved pairs for GLM-5, as
transformers has it) and GLM-5's `indexer_types`, where a `shared` layer reuses the previous layer's top-k.
"""

import dataclasses

from jaxmodels.configs.base import ConfigError, eos_token_ids, pop_alias, require_divisible, require_positive
from jaxmodels.configs.quantization import Fp8Config, fp8_config_from_hf
from jaxmodels.configs.rope import RopeConfig, rope_config_from_hf

INDEXER_NUMERICS = ("exact", "reference")


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rope: RopeConfig
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleaved: bool = False
    indexer_types: tuple[str, ...] = ()  # per layer "full" or "shared"; empty = all full
    indexer_numerics: str = "exact"  # "exact" (transformers) or "reference" (Hadamard + FP8, DeepSeek's code)
    mlp_layer_types: tuple[str, ...] = ()  # per layer "dense" or "sparse"
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 1
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    quantization: Fp8Config | None = None  # how an FP8 checkpoint stores its weights (None: unquantized)

    model_type = "deepseek_v32"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        return self.indexer_types or ("full",) * self.num_hidden_layers

    @property
    def mtp_mlp_layer_type(self) -> str:
        """The MLP of the MTP layers. Checkpoints number them on after the last decoder layer, past the
        `first_k_dense_replace` dense ones, so they are MoE in any model with MoE layers (every published one); the
        strict loader names the tensors if a checkpoint says otherwise."""
        return "sparse" if "sparse" in self.mlp_layer_types else "dense"

    @classmethod
    def from_hf(cls, raw: dict):
        num_layers = raw.get("num_hidden_layers")
        eos = eos_token_ids(raw)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if raw.get(name) is None:
                raise ConfigError(name, "is required")
        if raw.get("q_lora_rank") is None:
            raise ConfigError("q_lora_rank", "is required: the DSA indexer reads the q latent (q_lora_rank=None, "
                                             "the DeepSeek-V2-Lite layout, has no indexer)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
        first_dense = raw.get("first_k_dense_replace", 3)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None and isinstance(num_layers, int):
            n_dense = min(first_dense, num_layers)
            mlp_types = ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=raw["num_attention_heads"],
            q_lora_rank=raw["q_lora_rank"],
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            intermediate_size=raw.get("intermediate_size", 18432),
            rope=rope_config_from_hf(raw, raw["qk_rope_head_dim"]),
            index_n_heads=raw.get("index_n_heads", 64),
            index_head_dim=raw.get("index_head_dim", 128),
            index_topk=raw.get("index_topk", 2048),
            indexer_types=_indexer_types(raw, num_layers) if cls.model_type == "glm_moe_dsa" else (),
            indexer_rope_interleaved=cls.model_type == "glm_moe_dsa",
            indexer_numerics=raw.get("indexer_numerics", "exact"),
            mlp_layer_types=tuple(mlp_types),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            n_routed_experts=pop_alias(raw, "n_routed_experts", "num_local_experts", "num_experts", default=0),
            n_shared_experts=raw.get("n_shared_experts", 1),
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            n_group=raw.get("n_group", 1) or 1,
            topk_group=raw.get("topk_group", 1) or 1,
            norm_topk_prob=raw.get("norm_topk_prob", True),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            attention_bias=raw.get("attention_bias", False),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 0) or 0,
            eos_token_id=eos,
            quantization=fp8_config_from_hf(raw),
        )

    def __post_init__(self):
        require_positive(self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                         "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                         "index_head_dim", "index_topk")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError("index_head_dim", f"{self.index_head_dim} is smaller than the qk_rope_head_dim="
                                                f"{self.qk_rope_head_dim} rope channels the indexer rotates")
        if self.indexer_numerics not in INDEXER_NUMERICS:
            raise ConfigError("indexer_numerics", f"must be one of {INDEXER_NUMERICS}, got {self.indexer_numerics!r}")
        if self.indexer_numerics == "reference" and self.index_head_dim & (self.index_head_dim - 1):
            raise ConfigError("index_head_dim", f"the Hadamard rotation of reference numerics needs a power of two, "
                                                f"got {self.index_head_dim}")
        _check_per_layer(self, "mlp_layer_types", ("dense", "sparse"))
        if self.indexer_types:
            _check_per_layer(self, "indexer_types", ("full", "shared"))
            if self.indexer_types[0] != "full":
                raise ConfigError("indexer_types", "the first layer must be 'full': a 'shared' layer reuses the "
                                                   "top-k of the layer before it")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")
        if "dense" in self.mlp_layer_types:
            require_positive(self, "intermediate_size")
        if "sparse" in self.mlp_layer_types:
            self._check_moe()

    def _check_moe(self):
        require_positive(self, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                         "n_group", "topk_group")
        require_divisible(self, "n_routed_experts", "n_group")
        if self.topk_group > self.n_group:
            raise ConfigError("topk_group", f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        experts_in_groups = self.n_routed_experts // self.n_group * self.topk_group
        if self.num_experts_per_tok > experts_in_groups:
            raise ConfigError("num_experts_per_tok",
                              f"{self.num_experts_per_tok} exceeds the {experts_in_groups} experts of the selected "
                              "groups")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("n_group", "grouped routing scores each group by its top-2 experts: every group needs "
                                         "at least 2 experts")


@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    """GLM-5: same fields; interleaved indexer RoPE and per-layer `indexer_types` (set by `from_hf`)."""

    model_type = "glm_moe_dsa"


def _check_per_layer(cfg, field: str, allowed: tuple[str, ...]) -> None:
    values = getattr(cfg, field)
    if len(values) != cfg.num_hidden_layers:
        raise ConfigError(field, f"has {len(values)} entries for {cfg.num_hidden_layers} layers")
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(field, f"unknown values {unknown}; expected names among {list(allowed)}")


def _indexer_types(raw: dict, num_layers) -> tuple[str, ...]:
    """GLM-5's per-layer indexer mode, derived as transformers does when config.json does not list it."""
    listed = raw.get("indexer_types")
    if listed is not None:
        return tuple(listed)
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str):
            bad = sorted(set(pattern) - set(letters))
            if bad:
                raise ConfigError("index_topk_pattern", f"unknown letters {bad} in {pattern!r} (F=full, S=shared)")
            return tuple(letters[c] for c in pattern)
        return tuple(pattern)
    freq = max(raw.get("index_topk_freq", 1), 1)
    offset = raw.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers or 0))
