"""The serving benchmark runs end to end on CPU with a tiny config (its numbers mean nothing here: the GPU run does),
transformers comparator included, and reports every phase."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmodels.__main__ import main
from jaxmodels.benchmark import FP8_BLOCK_QUANTIZATION, balance_routing, center_lm_head, check_random_weights_fit
from jaxmodels.benchmark_floors import model_costs
from jaxmodels.families import load_config
from jaxmodels.layers.fp8_linear import Fp8ExpertStack, Fp8Linear
from jaxmodels.nnx_params import model_params
from jaxmodels.quantization import with_fp8_weights
from tests.hf_models import TINY_CONFIGS, build_from_config
from tests.jaxmodels.conftest import TINY


@pytest.mark.slow
def test_benchmark_reports_every_phase(bench_run):
    _, _, data, out = bench_run
    assert [(row["batch"], row["sampling"]) for row in data["decode"]] == [
        (1, "plain"), (1, "penalties"), (4, "plain"), (4, "penalties")]
    assert all(row["step_ms"] > 0 and 0 < row["host_share"] <= 1 for row in data["decode"])
    assert data["prefill"]["tokens"] == 40
    assert [row["rate"] for row in data["serve"]] == [0.0, 50.0]
    assert data["serve"][0]["out_tok_s"] > 0
    assert [row["batch"] for row in data["transformers"]["decode"]] == [1, 4]
    assert "### serving run" in out
    assert "cut_off_after" not in data  # the run's end rewrote the partial JSON whole
    printed = [line for line in out.strip().splitlines() if not line.startswith("figure: ")]  # --plot's paths
    assert printed[-1].startswith("headline: decode B=4")


@pytest.mark.parametrize("launch_thread", [[], ["--no-launch-thread", "--no-prefix-caching"]])
def test_profile_covers_only_the_measured_phases(tmp_path, capsys, launch_thread):
    """Without the prefill phase the engine is not sized for the (default 4096-token) prefill prompt, so the
    profile must not run it; the results JSON is written before profiling. With a launch thread (the default) the
    traced steps end with that thread's last launch (Runner.block_until_ready), not with caches it has yet to
    replace. (The second run also turns prefix caching off, which the results record.)"""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    results = tmp_path / "results.json"
    main(["bench", "--config", str(config), "--layers", "2", "--phases", "decode", "--batches", "2",
          "--prompt-len", "8", "--decode-steps", "4", "--dtype", "float32", "--no-progress",
          "--json", str(results), "--profile", str(tmp_path / "traces"), *launch_thread])
    out = capsys.readouterr().out
    data = json.loads(results.read_text())
    assert data["decode"][0]["batch"] == 2 and data["prefix_caching"] == ("--no-prefix-caching" not in launch_thread)
    assert "## profile: decode B=2" in out
    assert "## profile: prefill" not in out


def test_a_run_cut_off_keeps_the_phases_it_measured(tmp_path, monkeypatch):
    """The JSON is written after the decode and prefill phases, marked with the last one done: a run stopped during
    the serving phase (as by a device call's time limit) leaves both phases' rows, and bench-report says it was cut
    off."""
    from jaxmodels import benchmark
    from jaxmodels.benchmark_report import provenance_line

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt("the time limit")

    monkeypatch.setattr(benchmark, "serve_phase", stopped)
    config, results = tmp_path / "config.json", tmp_path / "results.json"
    config.write_text(json.dumps(TINY))
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--config", str(config), "--layers", "2", "--batches", "2", "--prompt-len", "8",
              "--decode-steps", "4", "--prefill-len", "16", "--dtype", "float32", "--no-progress",
              "--json", str(results)])
    data = json.loads(results.read_text())
    assert data["cut_off_after"] == "prefill"
    assert [row["batch"] for row in data["decode"]] == [2] and data["prefill"]["tokens"] == 16
    assert "serve" not in data
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "results.json"]  # no .tmp left
    assert provenance_line(data).endswith("; the run was cut off after its prefill phase)")


TINY_DSA = TINY_CONFIGS["deepseek_v32"]


@pytest.mark.parametrize("mtp_layers", [0, 1])
def test_balanced_routers_standardize_each_experts_logit_on_the_calibration_prompt(float32_matmuls, mtp_layers):
    """After balance_routing, each expert's logit has mean 0 and standard deviation 1 over the router's calibration
    inputs, and its score, bias included, averages zero there: the target's routers and the MTP layer's, which
    drafts over the target's hidden states. A second pass on the same ids sees those inputs again (each layer was
    balanced before it routed), so they are recorded there."""
    from jaxmodels.layers.moe import MoE

    model = build_from_config({**TINY_DSA, "num_nextn_predict_layers": mtp_layers})
    ids = np.random.default_rng(1).integers(3, TINY_DSA["vocab_size"], size=(1, 24))
    balance_routing(model, ids)
    inputs, route = [], MoE.route
    MoE.route = lambda self, x: (inputs.append((self, x)), route(self, x))[1]
    try:
        hidden = model.hidden_states(ids)
        if mtp_layers:
            model.mtp_step(hidden[:, :-1], ids[:, 1:])
    finally:
        MoE.route = route
    moe_layers = TINY_DSA["num_hidden_layers"] - TINY_DSA["first_k_dense_replace"]
    assert len({id(moe) for moe, _ in inputs}) == moe_layers + mtp_layers
    for moe, x in inputs:
        logits = np.asarray(moe.gate.logits(x), np.float64)
        np.testing.assert_allclose(logits.mean(axis=0), 0, atol=1e-5)
        np.testing.assert_allclose(logits.std(axis=0), 1, rtol=1e-5)
        scores = 1 / (1 + np.exp(-logits))
        np.testing.assert_allclose(scores.mean(axis=0) + np.asarray(moe.gate.e_score_correction_bias[...]), 0,
                                   atol=1e-6)


def router_inputs(rng, size: int):
    """A sampler of router inputs shaped like a random model's: a vector shared by every token, 32 dominant
    directions of decaying weight, and an isotropic rest; `draw(tokens)` -> [tokens, size]."""
    shared = 5 * rng.standard_normal(size)
    dominant = rng.standard_normal((32, size)) / np.sqrt(np.arange(1, 33))[:, None]

    def draw(tokens: int) -> np.ndarray:
        return (shared + 2 * rng.standard_normal((tokens, 32)) @ dominant
                + 0.5 * rng.standard_normal((tokens, size))).astype(np.float32)

    return draw


def expert_loads(gate, x, top_k: int, n_group: int, topk_group: int) -> np.ndarray:
    """Each expert's share of the (token, expert) picks of grouped top-k routing over x, in units of a uniform share."""
    from jaxmodels.layers.moe import grouped_topk_routing

    _, experts = grouped_topk_routing(gate.logits(jnp.asarray(x)), gate.e_score_correction_bias[...], top_k=top_k,
                                      n_group=n_group, topk_group=topk_group, norm_topk_prob=True,
                                      routed_scaling_factor=1.0)
    num_experts = gate.e_score_correction_bias.shape[0]
    return np.bincount(np.asarray(experts).ravel(), minlength=num_experts) / experts.size * num_experts


def test_standardized_router_spreads_unseen_tokens_over_every_expert(float32_matmuls):
    """On inputs with a shared vector and a few dominant directions, as random layers make them, centering only the
    scores (the bias) leaves a random router's load skewed: the experts whose rows meet the dominant directions most
    take several shares and others none. standardize_router, calibrated on one sample, spreads fresh tokens of the
    same kind over every expert, each within half a share of uniform (8,000 picks of 64 experts, 125 each: Poisson
    noise alone is 0.09 of a share, and experts that share directions add some)."""
    from jaxmodels.benchmark import standardize_router
    from jaxmodels.layers.moe import TopkRouter

    size, experts, routing = 256, 64, dict(top_k=4, n_group=4, topk_group=2)
    draw = router_inputs(np.random.default_rng(0), size)
    calibration, unseen = draw(2048), draw(2000)
    gate = TopkRouter(size, experts, rngs=nnx.Rngs(0))
    scores = 1 / (1 + np.exp(-np.asarray(gate.logits(jnp.asarray(calibration)), np.float64)))
    gate.e_score_correction_bias.set_value(jnp.asarray(-scores.mean(axis=0), jnp.float32))
    centered_only = expert_loads(gate, unseen, **routing)
    assert centered_only.max() > 2 and (centered_only == 0).sum() >= 3, centered_only
    standardize_router(gate, jnp.asarray(calibration))
    standardized = expert_loads(gate, unseen, **routing)
    assert 0.5 <= standardized.min() and standardized.max() <= 1.5, standardized


def test_centered_lm_head_scores_nothing_along_the_shared_direction(float32_matmuls):
    """center_lm_head removes from the head the mean direction of the hidden states it is given (random weights
    push every token's state along one shared vector, and greedy decoding then picks the same tokens for every
    request): the mean state scores zero on every token, a state orthogonal to it keeps its scores, and the head
    keeps its shape and dtype."""
    model = build_from_config(TINY_DSA)
    size = model.config.hidden_size
    rng = np.random.default_rng(0)
    shared = 10 * rng.standard_normal(size)
    hidden = (shared + rng.standard_normal((1, 16, size))).astype(np.float32)  # [1, T, H], as balance_routing's
    mean = hidden.reshape(-1, size).mean(axis=0)
    orthogonal = rng.standard_normal(size)
    orthogonal -= (orthogonal @ mean) / (mean @ mean) * mean
    kernel = model.lm_head.kernel[...]
    before = np.asarray(model.logits(jnp.asarray(np.stack([mean, orthogonal]), jnp.float32)))
    center_lm_head(model, jnp.asarray(hidden))
    after = np.asarray(model.logits(jnp.asarray(np.stack([mean, orthogonal]), jnp.float32)))
    assert model.lm_head.kernel.shape == kernel.shape and model.lm_head.kernel.dtype == kernel.dtype
    assert np.abs(before[0]).max() > 1  # the mean state did score tokens
    assert np.abs(after[0]).max() < 1e-5 * np.abs(before[0]).max()
    np.testing.assert_allclose(after[1], before[1], rtol=1e-5, atol=1e-5 * np.abs(before[1]).max())


def test_fp8_block_model_holds_fp8_weights_and_its_floors_count_their_bytes():
    """The benchmark's FP8 model: the layers DeepSeek-V3.2's checkpoint quantizes hold e4m3 weights with block
    scales; one routed expert (three 20 x 48 projections, one 128 x 128 block each) takes one byte per weight plus
    4 per scale, a quarter of its float32 bytes plus 12, and the model multiplies by as many weights per token."""
    model = build_from_config(TINY_DSA)  # random_model's model, unbalanced: routing changes no cost
    dense_costs = model_costs(model.config, model_params(model), "float32")
    # What random_model does with the quantization config.
    fp8 = with_fp8_weights(model, load_config({**TINY_DSA, "quantization_config": FP8_BLOCK_QUANTIZATION}),
                           quantize=True)
    stacks = [m for _, m in nnx.iter_modules(fp8) if isinstance(m, Fp8ExpertStack)]
    assert stacks and all(s.weight.dtype == jnp.float8_e4m3fn for s in stacks)
    assert any(isinstance(m, Fp8Linear) for _, m in nnx.iter_modules(fp8))
    fp8_costs = model_costs(fp8.config, model_params(fp8), "float32")
    assert fp8_costs.expert_bytes == dense_costs.expert_bytes / 4 + 3 * 4
    assert fp8_costs.dense_weight_bytes < dense_costs.dense_weight_bytes / 2
    assert fp8_costs.active_params_per_token == dense_costs.active_params_per_token
    assert 0 < fp8_costs.fp8_params_per_token < fp8_costs.active_params_per_token  # the LM head stays dense
    assert dense_costs.fp8_params_per_token == 0


class _Device:
    """A device as `check_random_weights_fit` reads it: its kind and its memory stats."""

    device_kind = "a small GPU"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_random_weights_too_large_for_the_device_are_a_clear_error():
    """The check counts the weights the model would hold (its built params' bytes, float32 norms included) against
    JAX's limit on the device, from the model's shapes: one byte over is refused with the sizes and what to do, the
    exact size passes, and a device without a reported limit (the CPU) is not checked."""
    def build():
        return build_from_config(TINY_DSA)

    weights = sum(param.nbytes for param in model_params(build()).values())
    with pytest.raises(SystemExit, match=rf"take {weights / 1e9:.1f} GB .* on a small GPU: keep fewer layers"):
        check_random_weights_fit(build, _Device({"bytes_limit": weights - 1}))
    check_random_weights_fit(build, _Device({"bytes_limit": weights}))
    check_random_weights_fit(build, _Device(None))


@pytest.mark.slow
def test_benchmark_serves_the_fp8_block_model(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_DSA))
    results = tmp_path / "results.json"
    main(["bench", "--config", str(config), "--phases", "prefill,decode", "--batches", "2", "--prompt-len", "8",
          "--decode-steps", "4", "--prefill-len", "24", "--prefill-chunk", "16", "--dtype", "float32", "--fp8-block",
          "--no-progress", "--json", str(results)])
    out = capsys.readouterr().out
    data = json.loads(results.read_text())
    assert data["weights"] == "fp8-block"
    assert data["decode"][0]["step_ms"] > 0 and data["prefill"]["floor_ms"] > 0
    assert "fp8-block weights" in out


def test_multiturn_workload_compares_prefix_caching_on_and_off(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    results = tmp_path / "results.json"
    main(["bench", "--workload", "multiturn", "--config", str(config), "--layers", "2", "--conversations", "2",
          "--turns", "3", "--system", "40", "--user", "9", "--answer", "5", "--prefill-chunk", "16",
          "--dtype", "float32", "--no-progress", "--json", str(results)])
    data = json.loads(results.read_text())
    on, off = data["runs"]
    assert (on["prefix_caching"], off["prefix_caching"]) == ("on", "off")
    assert on["requests"] == off["requests"] == 6 and on["out_tok_s"] > 0 and off["out_tok_s"] > 0
    # Turns 2 and 3 (prompts of 63 and 77 tokens) resume at 48, the last page edge (16-token pages) before the end
    # of the previous turn's prompt (49 and 63 tokens).
    assert on["hit_tokens"] >= 2 * 2 * 48 and 0 < on["hit_rate"] < 1 and off["hit_tokens"] == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("headline: prefix caching: TTFT p50")
