"""RoPE parameters (plain and YaRN), as HF `rope_parameters` give them; the math is in jaxmodels/layers/rope.py.

Kept apart from any family's config so that the rope layer depends on no model family.
"""

import dataclasses

from jaxmodels.configs.base import ConfigError

ROPE_TYPES = ("default", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE over the `dim` rope channels; YaRN when `rope_type == "yarn"` (fields as in HF `rope_parameters`)."""

    dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError("rope_parameters.rope_type", f"unsupported {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.dim % 2:
            raise ConfigError("qk_rope_head_dim", f"must be even for RoPE, got {self.dim}")
        if self.theta <= 0:
            raise ConfigError("rope_parameters.rope_theta", f"must be positive, got {self.theta}")
        if self.rope_type == "yarn" and not self.factor > 0:
            raise ConfigError("rope_parameters.factor", f"YaRN needs a positive factor, got {self.factor}")


def rope_config_from_hf(raw: dict, dim: int) -> RopeConfig:
    """`rope_parameters` (transformers >= 5) or the legacy `rope_theta` + `rope_scaling` pair."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    max_positions = raw.get("max_position_embeddings", 4096)
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                                        max_positions))
    factor = params.get("factor")
    if factor is None:  # transformers infers it from the context lengths (DeepSeek's convention)
        factor = max_positions / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        dim=dim,
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
