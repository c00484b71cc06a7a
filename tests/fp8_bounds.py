"""How far FP8 serving may move a model's logits from the dense model's: the bound derived in
tests/jaxmodels/test_fp8_checkpoints.py, and the ties it leaves to greedy decoding."""

import math

import numpy as np
from flax import nnx

from jaxmodels.layers.fp8_linear import Fp8ExpertStack, Fp8Linear

EPSILON = 2.0 ** -4 / math.sqrt(3)  # the relative RMS error one FP8 GEMM adds at most
GEMMS_IN_SERIES = {"nemotron_h": 2, "deepseek_v32": 5, "glm_moe_dsa": 5}  # per layer holding FP8 layers
TIE_SIGMAS = 3


def fp8_gemms_in_series(model) -> int:
    """The bound's n: FP8 GEMMs in series per layer (in -> out, (q, k, v) -> o or up -> down in a Nemotron-H block;
    q_a -> q_b -> o_proj and (gate, up) -> down in a DSA layer), over the layers that hold FP8 layers."""
    quantized = [layer for layer in model.layers
                 if any(isinstance(m, (Fp8Linear, Fp8ExpertStack)) for _, m in nnx.iter_modules(layer))]
    return GEMMS_IN_SERIES[model.config.model_type] * len(quantized)


def rms_bound(model) -> float:
    """The most relative RMS error the FP8 rounding of activations leaves in the logits: √n · 2^-4 / √3."""
    return math.sqrt(fp8_gemms_in_series(model)) * EPSILON


def is_tie(reference_logits, model) -> bool:
    """Whether FP8 rounding may swap the reference's top two logits: their margin is within TIE_SIGMAS standard
    deviations of the difference of two logits' errors, each of RMS at most `rms_bound` of the logits' RMS."""
    top2 = np.sort(reference_logits)[-2:]
    spread = math.sqrt(2) * rms_bound(model) * float(np.sqrt(np.mean(np.square(reference_logits))))
    return top2[1] - top2[0] <= TIE_SIGMAS * spread
