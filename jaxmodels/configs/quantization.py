"""How an FP8 checkpoint stores its linear weights: `quantization_config` in `config.json`.

Two published formats:
  * `quant_method: "fp8"` (DeepSeek-V3.2, GLM-5; transformers' fine-grained FP8): float8_e4m3fn weights with one
    float32 `weight_scale_inv` per `weight_block_size` = [128, 128] block, activations quantized dynamically
    (`activation_scheme: "dynamic"`), activation scales rounded up to powers of two when `scale_fmt: "ue8m0"`.
    `modules_to_not_convert` names modules left unquantized.
  * `quant_method: "modelopt"`, `quant_algo: "FP8"` (NVIDIA's FP8 Nemotron-H): one float32 `weight_scale` per weight
    and a static `input_scale` per layer. The exclusions are `ignore` (config.json) or, in the layout of
    `hf_quant_config.json` nested under `quantization`, `exclude_modules`; ModelOpt writes wildcards there. With
    `kv_cache_quant_algo: "FP8"` the attention layers also carry the static scales of an FP8 KV cache, one float32
    `k_proj.k_scale` and `v_proj.v_scale` each (ModelOpt's unified export); our KV cache keeps the model's dtype, as
    vLLM's and SGLang's do unless asked for FP8 (`kv_cache_dtype`), so they are read past.
Which layers a checkpoint quantizes is otherwise the family's published fact (see jaxmodels.quantization).
"""

import dataclasses

from jaxmodels.configs.base import ConfigError

SUPPORTED = "'fp8' (block-scaled, as DeepSeek-V3.2 / GLM-5 publish) or 'modelopt' with quant_algo 'FP8' (per-tensor)"


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int] | None  # (rows, columns) of the weight one scale covers; None: one scale per tensor
    pow2_scales: bool = False  # activation scales are powers of two (`scale_fmt: ue8m0`)
    unquantized: tuple[str, ...] = ()  # checkpoint module names (ModelOpt wildcards allowed) kept unquantized
    kv_cache_scales: bool = False  # the attention layers carry FP8 KV-cache scales (k_proj.k_scale, v_proj.v_scale)


def fp8_config_from_hf(raw: dict) -> Fp8Config | None:
    """The FP8 format `raw` (a parsed config.json) declares, None for an unquantized checkpoint, or a ConfigError
    naming what is not supported."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        return _block_fp8(quant)
    if method == "modelopt":
        return _modelopt_fp8(quant)
    raise ConfigError("quantization_config", f"unsupported quant_method {method!r}; supported: {SUPPORTED}")


def _block_fp8(quant: dict) -> Fp8Config:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError("quantization_config", f"fp8 fmt {fmt!r} is not supported; only 'e4m3'")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError("quantization_config", f"fp8 activation_scheme {scheme!r} is not supported with block "
                                                 "scales; only 'dynamic'")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError("quantization_config", f"fp8 weight_block_size must be two positive integers (e.g. "
                                                 f"[128, 128]), got {block!r}")
    scale_fmt = quant.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise ConfigError("quantization_config", f"fp8 scale_fmt {scale_fmt!r} is not supported; None or 'ue8m0'")
    return Fp8Config(block=tuple(block), pow2_scales=scale_fmt == "ue8m0",
                     unquantized=tuple(quant.get("modules_to_not_convert") or ()))


def _modelopt_fp8(quant: dict) -> Fp8Config:
    nested = quant.get("quantization")
    algo = (nested or quant).get("quant_algo")
    if str(algo).upper() != "FP8":
        raise ConfigError("quantization_config", f"modelopt quant_algo {algo!r} is not supported; only 'FP8' "
                                                 "(per-tensor weight and static activation scales)")
    excluded = nested.get("exclude_modules") if nested is not None else quant.get("ignore")
    kv_cache = (nested or quant).get("kv_cache_quant_algo")
    if kv_cache is not None and str(kv_cache).upper() != "FP8":
        raise ConfigError("quantization_config", f"modelopt kv_cache_quant_algo {kv_cache!r} is not supported; None "
                                                 "or 'FP8' (whose scales go unused: the KV cache keeps the model's "
                                                 "dtype)")
    return Fp8Config(block=None, unquantized=tuple(excluded or ()), kv_cache_scales=kv_cache is not None)
