"""How far FP8 serving may move a model's logits from the dense model's: the bound derived in
tests/jaxmodels/test_fp8_checkpoints.py, and the ties it leaves to greedy decoding."""

import math

import numpy as np
from flax import nnx

from jaxmodels.layers.fp8_linear import Fp8ExpertStack, Fp8Linear

EPSILON = 2.0 ** -4 / math.sqrt(3)  # the relative RMS error one FP8 GEMM adds at most
GEMMS_IN_SERIES = {"nemotron_h": 2, "deepseek_v32": 5, "glm_moe_dsa": 5}  # per layer holding FP8 layers
TIE_SIGMAS = 3
# The FP8 tensor cores' accumulation keeps about 14 bits within each 128-term chain: a GEMM on them is within about
# 2^-13 of sum |terms| of the exact sum; twice that is the bound (tests/pallas_kernels/test_fp8_matmul.summation_bound).
TENSOR_CORE_BOUND = 2.0 ** -12


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


def fp8_gemms_run_on_tensor_cores() -> bool:
    """Whether `auto` FP8 GEMMs run on a GPU's FP8 tensor cores here (a GPU, with the GPU paths taken): then results
    are held to TENSOR_CORE_BOUND, not to the float32 reference's summation error."""
    import importlib

    from pallas_kernels import _dispatch

    # The package exports the function `fp8_matmul` under the module's name, so `from pallas_kernels import
    # fp8_matmul` is the function; the flag lives in the module.
    fp8_matmul_module = importlib.import_module("pallas_kernels.fp8_matmul")
    return _dispatch.on_gpu() and fp8_matmul_module.GPU_PATHS_VERIFIED


def assert_within_summation_bound(got, want, bound):
    """|got - want| <= bound, per element (a summation bound: float32's or the tensor cores')."""
    error = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert (error <= bound).all(), f"worst error {(error / bound).max():.2f}x the summation bound"
