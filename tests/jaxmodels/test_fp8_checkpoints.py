"""FP8 checkpoints served in FP8: tiny DeepSeek-V3.2 and GLM-5 checkpoints in block FP8 and tiny Nemotron-H ones in
per-tensor FP8 (NVIDIA ModelOpt), made by tests/hf_fp8.py the way the published ones are, loaded by `load_model` and
served by `LLM`. The reference is transformers on the checkpoint's weights dequantized (w8 · scale, exact in float32).

* quantization="dequantize" loads those weights into a dense model: it equals transformers within 1e-4 relative,
  the float32 tolerance of the other parity tests.
* Served in FP8, the logits differ from transformers' by the e4m3 rounding of each FP8 GEMM's input activations
  alone (weights dequantize exactly). The bound, derived:
    - A value rounded to e4m3 (3 mantissa bits, round to nearest) errs by at most u = 2^-4 of itself while it is a
      normal e4m3 number, i.e. above 2^-6 of its scale, and by at most 2^-10 of the scale below (a block's scale maps
      its largest value to 448, so those are values under 448 · 2^-6 / 448 ≈ 4e-5 of the block's largest: they
      weigh nothing here). tests/pallas_kernels/test_fp8_matmul.py checks both limits.
    - An FP8 GEMM output y = Σ_k x_k w_k then errs by e = Σ_k δ_k x_k w_k with |δ_k| <= u. Rounding errors are
      independent and zero-mean, and a value's relative error is spread over [-u, u] (RMS <= u / √3), so E[e²] <=
      (u / √3)² Σ_k x_k² w_k²; with weights uncorrelated with the errors, Σ_k x_k² w_k² is E[y²]. Each FP8 GEMM adds
      at most ε = 2^-4 / √3 ≈ 0.036 relative RMS error to its output (random data measure 0.026).
    - Errors of successive GEMMs are independent and add in quadrature: after n FP8 GEMMs in series a value carries
      at most √n · ε. Norms pass relative errors through; residual sums and the LM head (not FP8) do not enlarge
      them. n counts the FP8 GEMMs in series per layer: q_a -> q_b -> o_proj and (gate, up) -> down in a DSA layer
      (5), in -> out (Mamba), (q, k, v) -> o (attention) and up -> down (MLP, experts) in a quantized Nemotron-H
      block (2).
  So the logits' relative RMS error (`rms_relative_error`) is at most √n · 2^-4 / √3 (tests/fp8_bounds.py): 0.11
  for the two-layer DSA models (n = 10), 0.09 for the Nemotron-H one (three quantized blocks, n = 6), which measure
  0.04 and 0.03. It holds while no discrete choice hangs on the rounding: these models send every token to every
  expert and keep every key (tests/hf_fp8.py).
* Greedy tokens through `LLM.generate` follow transformers', ties aside: where they first part, transformers' top-2
  margin must be within three standard deviations of the difference of two logits' errors, 3 · √2 · √n ε · RMS of
  the logits (tests/fp8_bounds.py).
* Every FP8 layer computes the GEMM its format defines: our layer and transformers' (its input quantized in torch as
  the format says) on the same input differ by float32 summation order alone, 1e-6 relative as in the kernel tests;
  on a GPU's FP8 tensor cores by their accumulation's, 2^-12 of the sum of |terms| per output (tests/fp8_bounds.py).
* The weights stay FP8 on the device: one byte per parameter plus float32 scales, read from the device buffers.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.layers.fp8_linear import Fp8ExpertStack, Fp8Linear
from jaxmodels.nnx_params import model_params
from tests.fp8_bounds import (TENSOR_CORE_BOUND, assert_within_summation_bound, fp8_gemms_run_on_tensor_cores,
                              is_tie, rms_bound)
from tests.hf_fp8 import FP8_CASES, linear_weights, make_fp8_case
from tests.hf_models import logits_of
from tests.numerics import max_relative_error, rms_relative_error

PROMPT_LENGTHS = [3, 13, 27]  # 8-token prefill chunks: one, two and four of them
NEW_TOKENS = 10
# One prefill and one decode bucket: the fewest programs to compile. Greedy requests only: warm-up "all" compiles
# no samplers for sampled or logit-adjusting requests (the default warm-up compiles them in the background).
LIMITS = dict(max_batch_size=4, max_seq_len=48, prefill_sizes=[8], decode_sizes=[4], progress=False, warmup="all")


def prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]


def logits_inputs(vocab_size: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab_size, size=(2, 17))


@pytest.fixture(scope="module", params=FP8_CASES)
def case(request, tmp_path_factory):
    """(case name, Fp8Checkpoint, our model loaded in FP8). Per-tensor input scales are calibrated on the inputs the
    tests feed (ModelOpt's max calibration), so that no activation saturates."""
    vocab = 101 if request.param.startswith(("deepseek", "glm")) else 97
    calibration = [logits_inputs(vocab), *(np.array([p]) for p in prompts(vocab))]
    fp8 = make_fp8_case(request.param, tmp_path_factory.mktemp(request.param), calibration_ids=calibration)
    return request.param, fp8, jaxmodels.load_model(fp8.fp8_dir, progress=False)


def jitted_logits(model, input_ids) -> np.ndarray:
    """The cache-free forward compiled as one program (op by op, every op would compile on its own)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))(state, jnp.asarray(input_ids)))


def checkpoint_names(path: tuple, layer) -> list[str]:
    """The checkpoint's (normalized) names of the weights an FP8 layer of ours at `path` holds."""
    base = ".".join(str(part) for part in path)
    if isinstance(layer, Fp8ExpertStack):
        experts, projection = base.rsplit(".", 1)
        return [f"{experts}.{j}.{projection}.weight" for j in range(layer.weight.shape[0])]
    return [base + ".weight"]


def fp8_layers(model) -> list:
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, (Fp8Linear, Fp8ExpertStack))]


def test_the_published_layers_are_fp8_and_nothing_else(case):
    _, fp8, model = case
    ours = {name for path, layer in fp8_layers(model) for name in checkpoint_names(path, layer)}
    assert ours == set(fp8.quantizers)
    fp8_params = {path for path, value in model_params(model).items() if value.dtype == jnp.float8_e4m3fn}
    assert fp8_params == {".".join(map(str, path)) + ".weight" for path, _ in fp8_layers(model)}


def test_dequantized_load_equals_transformers(case):
    _, fp8, _ = case
    model = jaxmodels.load_model(fp8.fp8_dir, progress=False, quantization="dequantize")
    assert not fp8_layers(model)
    input_ids = logits_inputs(model.config.vocab_size)
    assert max_relative_error(jitted_logits(model, input_ids), logits_of(fp8.reference, input_ids).numpy()) < 1e-4


def test_fp8_logits_are_within_the_e4m3_rounding_bound(case):
    _, fp8, model = case
    input_ids = logits_inputs(model.config.vocab_size)
    expected = logits_of(fp8.reference, input_ids).numpy()
    got = jitted_logits(model, input_ids)
    assert got.shape == expected.shape
    assert rms_relative_error(got, expected) < rms_bound(model)


def test_every_fp8_layer_computes_its_formats_gemm(case):
    _, fp8, model = case
    torch_weights = linear_weights(fp8.reference)
    rng = np.random.default_rng(2)
    for path, layer in fp8_layers(model):
        names = checkpoint_names(path, layer)
        rows_per_weight = 3
        x = rng.standard_normal((rows_per_weight * len(names), layer.in_features)).astype(np.float32)
        if isinstance(layer, Fp8ExpertStack):
            got = np.asarray(layer(jnp.asarray(x), jnp.full((len(names),), rows_per_weight, jnp.int32)))
        else:
            got = np.asarray(layer(jnp.asarray(x)))
        for i, name in enumerate(names):
            rows = slice(i * rows_per_weight, (i + 1) * rows_per_weight)
            with torch.no_grad():
                x_seen = fp8.quantizers[name](torch.from_numpy(x[rows]))
                want = torch.nn.functional.linear(x_seen, torch_weights[name])
            if fp8_gemms_run_on_tensor_cores():
                terms = np.abs(x_seen.double().numpy()) @ np.abs(torch_weights[name].detach().double().numpy()).T
                assert_within_summation_bound(got[rows], want.numpy(), TENSOR_CORE_BOUND * terms)
            else:
                assert rms_relative_error(got[rows], want.numpy()) < 1e-6, name


def test_weights_take_one_byte_per_parameter_plus_scales(case):
    """Read from the device buffers of the model and of the engine serving it: the FP8 layers' weights take one byte
    per parameter (as many as the checkpoint's quantized weights have) plus four per scale, and no dense copy of
    them exists."""
    _, fp8, _ = case
    model = jaxmodels.load_model(fp8.fp8_dir, dtype="bfloat16", progress=False)
    quantized_parameters = sum(math.prod(linear_weights(fp8.reference)[name].shape) for name in fp8.quantizers)
    layers = {".".join(map(str, path)) for path, _ in fp8_layers(model)}
    params = model_params(model)
    weight_bytes = sum(params[layer + ".weight"].on_device_size_in_bytes() for layer in layers)
    scales = [value for path, value in params.items()
              if path.rsplit(".", 1)[0] in layers and not path.endswith((".weight", ".bias"))]
    assert weight_bytes == quantized_parameters
    assert sum(s.on_device_size_in_bytes() for s in scales) == 4 * sum(s.size for s in scales)
    assert not any(path.startswith(tuple(layer + "." for layer in layers)) and path.endswith("kernel")
                   for path in params)
    # Everything else keeps the dtype it has unquantized: the model's, float32 for routers and the indexer's weights.
    for path, value in params.items():
        if path.rsplit(".", 1)[0] not in layers:
            float32 = ".gate." in path or "weights_proj" in path
            assert value.dtype == (jnp.float32 if float32 else jnp.bfloat16), path
    llm = jaxmodels.LLM(None, model=model, dtype="bfloat16", **{**LIMITS, "warmup": False})
    served = dict(zip(llm.engine.runner.param_names, llm.engine.runner.params))
    assert sum(served[layer + ".weight"].on_device_size_in_bytes() for layer in layers) == quantized_parameters


def hf_greedy(reference, prompt):
    """transformers' greedy tokens and the logits it chose each from."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [scores[0].numpy() for scores in out.scores]


def test_greedy_tokens_follow_transformers_ties_aside(case):
    name, fp8, model = case
    llm = jaxmodels.LLM(fp8.fp8_dir, dtype="float32", **LIMITS)
    batch = prompts(model.config.vocab_size)
    for prompt, out in zip(batch, llm.generate(batch, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))):
        expected, scores = hf_greedy(fp8.reference, prompt)
        parted = next((i for i, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b), None)
        if parted is None:
            assert out.token_ids == expected
            continue
        assert is_tie(scores[parted], model), (name, len(prompt), parted)
