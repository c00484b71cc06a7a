"""FP8 checkpoints for tests, made here from tiny random transformers models the way the published ones are, and
the torch references to hold our FP8 models to.

`quantize_checkpoint` turns a saved float32 checkpoint into an FP8 one: the weights the published checkpoints
quantize become float8_e4m3fn with their float32 scales under the published names (block-scaled
`weight_scale_inv` per 128 x 128 block, DeepSeek-V3.2 / GLM-5; or per-tensor `weight_scale` plus a static
`input_scale` calibrated as ModelOpt does, NVIDIA), and config.json gains the published `quantization_config`. Beside
it goes the same checkpoint with those weights dequantized (w8 · scale, exact in float32), which transformers loads:
the reference. Each FP8 weight comes with the quantizer of its input activations (per token and 128 channels, or
with the static scale), written in torch from the formats' definitions, apart from the code under test.
"""

import dataclasses
import fnmatch
import functools
import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from bridge.checkpoint import normalize_name

FP8_MAX = 448.0
BLOCK = 128

# The linear weights DeepSeek-V3.2 and GLM-5 publish in block FP8 (normalized names): attention and indexer
# projections, dense MLPs, shared and routed experts. Not the LM head, the indexer's weights_proj, eh_proj, the router.
DSA_QUANTIZED = re.compile(r"^layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|"
                           r"indexer\.wq_b|indexer\.wk)|mlp\.(shared_experts\.|experts\.\d+\.)?"
                           r"(gate_proj|up_proj|down_proj))\.weight$")
# The linear weights of a Nemotron-H in ModelOpt FP8: every linear layer's (Mamba in/out, attention, MLP, experts,
# latent projections, MTP eh_proj) but the LM head; those the config excludes are left out by the caller.
NEMOTRON_H_LINEARS = re.compile(r"^(mtp\.)?layers\.\d+\.(mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|"
                                r"up_proj|down_proj|fc1_latent_proj|fc2_latent_proj|shared_experts\.(up_proj|"
                                r"down_proj)|experts\.\d+\.(up_proj|down_proj))|eh_proj)\.weight$")

DSA_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [BLOCK, BLOCK]}


def modelopt_quantization_config(excluded: list[str]) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": excluded,
            "producer": {"name": "modelopt", "version": "0.29.0"}}


# ---- quantizing weights ------------------------------------------------------------------------------------------

def _blocks(shape: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // BLOCK), -(-shape[1] // BLOCK)


def _expand(scale: torch.Tensor, shape) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: shape[0], : shape[1]]


def quantize_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], float32 scale [⌈N/128⌉, ⌈K/128⌉]), one scale = amax / 448 per block."""
    w = weight.float()
    rows, cols = _blocks(w.shape)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = padded.reshape(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / _expand(scale, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight -> (float8_e4m3fn, float32 scalar scale = amax / 448)."""
    w = weight.float()
    scale = w.abs().max() / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.ndim == 0:
        return w8.float() * scale
    return w8.float() * _expand(scale, w8.shape)


# ---- checkpoints ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Fp8Checkpoint:
    fp8_dir: str  # the FP8 checkpoint
    dequantized_dir: str  # the same with its quantized weights dequantized (float32)
    reference: torch.nn.Module  # transformers on the dequantized weights
    quantizers: dict  # {normalized name of each FP8 weight: the quantizer its input goes through}


def _write(directory, tensors: dict, config: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return os.fspath(directory)


def quantize_checkpoint(source, directory, *, quantized, block: bool, quantization_config: dict,
                        calibration_ids=()) -> Fp8Checkpoint:
    """The FP8 checkpoint (`directory`/fp8) made from the saved float32 checkpoint `source`, and its dequantized twin
    (`directory`/dequantized). `quantized(normalized name)` picks the weights. Per-tensor checkpoints calibrate each
    static input scale as ModelOpt does by default, from the largest |input| transformers feeds the layer (on the
    dequantized weights) over the token batches `calibration_ids`."""
    tensors = load_file(os.path.join(source, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    fp8, dense = {}, {}
    for name, tensor in tensors.items():
        if not quantized(normalize_name(name)):
            fp8[name] = dense[name] = tensor
            continue
        w8, scale = quantize_block(tensor) if block else quantize_tensor(tensor)
        fp8[name] = w8
        fp8[name[: -len("weight")] + ("weight_scale_inv" if block else "weight_scale")] = scale
        dense[name] = dequantize(w8, scale)
    dequantized_dir = _write(os.path.join(directory, "dequantized"), dense, config)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(dequantized_dir).eval()
    names = {normalize_name(name) for name in tensors if quantized(normalize_name(name))}
    if block:
        quantizers = dict.fromkeys(names, block_act_quant)
    else:
        amax = calibrate_input_amax(reference, names, calibration_ids)
        input_scales = {name: torch.tensor(amax[name] / FP8_MAX, dtype=torch.float32) for name in names}
        for name in tensors:
            if normalize_name(name) in names:
                fp8[name[: -len("weight")] + "input_scale"] = input_scales[normalize_name(name)]
        quantizers = {name: functools.partial(static_act_quant, input_scale=input_scales[name]) for name in names}
    fp8_dir = _write(os.path.join(directory, "fp8"), fp8, {**config, "quantization_config": quantization_config})
    return Fp8Checkpoint(fp8_dir, dequantized_dir, reference, quantizers)


# ---- torch references ----------------------------------------------------------------------------------------------

def linear_weights(hf_model) -> dict[str, torch.Tensor]:
    """{checkpoint name (normalized): weight} of a transformers model's linear weights, named as `save_pretrained`
    names them: each Linear's weight, and each expert's slice of the stacked expert parameters (transformers >= 5).
    Each is the tensor F.linear receives, or for fused gate_up experts its halves (DSA; not calibrated, so that the
    fused slice F.linear receives need not be told apart)."""
    weights = {}
    for name, tensor in hf_model.named_parameters():
        name = normalize_name(name)
        match = re.match(r"^(.*\.experts)\.(gate_up_proj|up_proj|down_proj)$", name)
        if match and match[2] == "gate_up_proj":  # gate rows first; the gate half starts where the slice does
            half = tensor.shape[1] // 2
            for j in range(tensor.shape[0]):
                weights[f"{match[1]}.{j}.gate_proj.weight"] = tensor[j, :half]
                weights[f"{match[1]}.{j}.up_proj.weight"] = tensor[j, half:]
        elif match:
            for j in range(tensor.shape[0]):
                weights[f"{match[1]}.{j}.{match[2]}.weight"] = tensor[j]
        elif name.endswith(".weight") and tensor.ndim == 2:
            weights[name] = tensor
    return weights


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale) · scale, the division as a product with the float32 reciprocal (as pallas_kernels.fp8_matmul
    spells it)."""
    return (x * (1 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale


def block_act_quant(x: torch.Tensor) -> torch.Tensor:
    """Per token and 128 channels, s = max(amax, 1e-4) / 448 (DeepSeek's act_quant)."""
    groups = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-4) * torch.tensor(1 / FP8_MAX, dtype=torch.float32)
    return _e4m3(groups, scale).reshape(x.shape)


def static_act_quant(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """With a static float32 scale (ModelOpt)."""
    return _e4m3(x.float(), input_scale)


def calibrate_input_amax(hf_model, names, batches) -> dict[str, float]:
    """Max calibration, as ModelOpt's default: the largest |input| each named linear weight sees over the token
    batches `batches`, read in F.linear (through which transformers' eager experts run one expert at a time; its
    default grouped ones do not)."""
    by_pointer = {tensor.data_ptr(): name for name, tensor in linear_weights(hf_model).items() if name in names}
    amax = {}
    original, experts = torch.nn.functional.linear, hf_model.config._experts_implementation

    def linear(x, weight, bias=None):
        name = by_pointer.get(weight.data_ptr())
        if name is not None:
            amax[name] = max(amax.get(name, 0.0), float(x.abs().max()))
        return original(x, weight, bias)

    hf_model.set_experts_implementation("eager")
    torch.nn.functional.linear = linear
    try:
        with torch.no_grad():
            for input_ids in batches:
                hf_model(torch.as_tensor(input_ids))
    finally:
        torch.nn.functional.linear = original
        hf_model.set_experts_implementation(experts)
    # An expert no calibration token reached takes the largest amax of its layer's experts of that projection.
    for name in set(names) - set(amax):
        stack = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
        amax[name] = max(v for n, v in amax.items() if re.sub(r"\.experts\.\d+\.", ".experts.*.", n) == stack)
    return amax


# ---- the tiny FP8 models -------------------------------------------------------------------------------------------

# Two layers each (one dense, one MoE; GLM-5's second shares the first's indexer), dims multiples of 128 where block
# scales cover them, but for kv_a_proj_with_mqa's 192 rows, which end in a half block as DeepSeek's 576 do. Every
# routed expert runs for every token and the indexer keeps every key, so that no discrete choice (expert, key) hangs
# on FP8 rounding: the logits then differ from the dense model's by rounding alone, which the tests bound. Weights
# drawn with std 0.02, as real models are initialized.
DSA_FP8 = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
               q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
               num_attention_heads=2, num_key_value_heads=2, index_n_heads=16, index_head_dim=64, index_topk=64,
               n_group=1, topk_group=1, num_experts_per_tok=8, initializer_range=0.02)
DSA_FP8_VARIANTS = {"deepseek_v32": {}, "glm_moe_dsa": dict(indexer_types=["full", "shared"])}
# Nemotron-H: a block of each kind (Mamba, attention, MLP, MoE). NVIDIA's exclusion lists leave the LM head, the Mamba
# convs and some layers unquantized: here the attention layer.
NEMOTRON_H_FP8 = dict(hybrid_override_pattern="M*-E", num_experts_per_tok=8, n_group=1, topk_group=1,
                      initializer_range=0.02)
NEMOTRON_H_FP8_EXCLUDED = ["lm_head", "backbone.layers.1.mixer*", "backbone.layers.*.mixer.conv1d"]
FP8_CASES = ("deepseek_v32", "glm_moe_dsa", "nemotron_h")


def make_fp8_case(case: str, directory, *, calibration_ids=(), **overrides) -> Fp8Checkpoint:
    """One of FP8_CASES (`overrides` for its config): DeepSeek-V3.2 / GLM-5 in block FP8, or Nemotron-H in per-tensor
    FP8 (ModelOpt) calibrated on `calibration_ids`."""
    from tests.hf_models import make_dsa, make_nemotron_h, save

    if case == "nemotron_h":
        source = save(make_nemotron_h("moe", **{**NEMOTRON_H_FP8, **overrides}), os.path.join(directory, "f32"))
        excluded = NEMOTRON_H_FP8_EXCLUDED

        def quantized(name):
            module = "backbone." + name.removesuffix(".weight")
            return bool(NEMOTRON_H_LINEARS.match(name)) and not any(fnmatch.fnmatchcase(module, p) for p in excluded)

        return quantize_checkpoint(source, directory, quantized=quantized, block=False,
                                   quantization_config=modelopt_quantization_config(excluded),
                                   calibration_ids=calibration_ids)
    source = save(make_dsa(case, **{**DSA_FP8, **DSA_FP8_VARIANTS[case], **overrides}), os.path.join(directory, "f32"))
    return quantize_checkpoint(source, directory, quantized=lambda name: bool(DSA_QUANTIZED.match(name)), block=True,
                               quantization_config=DSA_QUANTIZATION_CONFIG)
