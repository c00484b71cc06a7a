"""bfloat16 parity with transformers, where users run: logits and greedy tokens on tiny random checkpoints.

Runs. Every checkpoint is saved in bfloat16 (the float32 random model of tests/hf_models.py cast with
`.to(torch.bfloat16)`), so that all runs read the same rounded weights:
  * ours: `jaxmodels.load_model(dir, dtype="bfloat16")`, and `LLM(dir, dtype="bfloat16")` for greedy decoding;
  * theirs: `from_pretrained(dir, dtype=torch.bfloat16)`, what a user loading a bf16 checkpoint gets (the same
    logits as `dtype="auto"`). It keeps the rotary frequencies (and correction biases, router weights) in float32;
    `.to(torch.bfloat16)` on a loaded model rounds the rotary frequencies too and is not what users run;
  * reference: `from_pretrained(dir, dtype=torch.float32)`: the same weights in float32 arithmetic.
Expert widths of 20 (hf_models) become 24: transformers' default bf16 expert kernel (`grouped_mm`) needs 16-byte row
strides. Nemotron-H norm weights are drawn away from 1: a weight of 1 multiplies exactly and would hide the cast
order around a norm's weight multiply.

Discrete choices. Experts (routers) and keys (the DSA indexer) are top-k picks over float32 scores of bf16
activations. Where two candidates score within rounding of each other, two correct bf16 implementations may pick
differently, and one different pick moves that token's logits (and later tokens') by O(1) of their scale. That is
not arithmetic error, so the logits tests pin every choice of both bf16 runs to the float32 reference's and compare
arithmetic alone; `test_choices_differ_only_at_near_ties` checks the unpinned choices.

Bounds on logits (u = 2^-8, bfloat16's unit roundoff: a rounding is off by at most u relative, u/√3 in RMS):
  * E_ABS = 2^-4: max |ours - theirs| over all logits, relative to max |logits|. A path from the embedding to a logit
    crosses at most ~12 rounded operations per layer (norm, projections, activation, gating product, attention
    probabilities and output, residual add) over 3 to 7 layers plus the final norm and head: n <= 90. Independent
    roundings add in quadrature: √90·u/√3 ≈ 0.022 RMS relative error per implementation, √2 times that (0.030)
    between two. Over the ~4·10^3 logits of a batch the largest error is ~4 times its RMS while the largest logit
    is ~3.5 times the RMS logit: 0.030·4/3.5 ≈ 0.035. 2^-4 leaves a factor 1.8 for error growth through the layers.
  * RATIO = 2: our max error against float32 is at most twice transformers' bf16 error (floored at one rounding,
    u). Both round the same tensors at about the same places (ours keeps the Mamba conv and dt in float32 where
    transformers rounds them, and rounds the scan output, which transformers keeps in float32): twice as many
    roundings would give √2 times the error, and the ratio of two sample maxima of ~4·10^3 errors drifts by ~20%
    (1σ) from one set of roundings to another; √2·1.4 ≈ 2. This catches precision lost throughout the model (an
    activation, state or weight kept in too few bits everywhere), not one extra rounding at one site: at these sizes
    that moves the error by less than the spread of its maximum.

Near-ties. `noise` is the rounding noise between the two implementations where it is largest, at the logits: the
RMS of ours − theirs on the pinned batch relative to the RMS of theirs (the bounds above keep it small). Modelling
every bf16 activation as off by `noise` relative, independently per element, a float32 read-out Σ_i w_i·x_i moves
with standard deviation noise·(Σ_i w_i²·x_i²)^½, and the difference of two read-outs with at most √2 times the
larger one. A difference within Z = 5 such standard deviations is a near-tie (a Gaussian passes 5σ with probability
6·10^-7, so a flip beyond that is not rounding):
  * a greedy token: our token's logit is within Z·√2·noise·RMS(logits) of transformers' best, in the logits
    transformers chose from;
  * a router choice, over sigmoid(w·x) + b (slope at most 1/4); group scores sum two experts (half their margin
    compares alike);
  * an indexer choice, over Σ_h w_h·relu(q_h·k): q and k move every channel, w_h its head's whole term.

These checks run on the CPU in CI and on the GPU, where XLA's bf16 dots accumulate in float32 on tensor cores and
fusions round elsewhere: the bounds count roundings, and `noise` is measured on the platform that runs.
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxmodels
from jaxmodels import SamplingParams
from jaxmodels.layers.indexer import LightningIndexer
from jaxmodels.layers.moe import MoE
from tests.hf_models import make_dsa, make_nemotron_h
from tests.numerics import max_relative_error, rms_relative_error

U = 2.0**-8
E_ABS = 2.0**-4
RATIO = 2.0
Z = 5.0

NEMOTRON_VARIANTS = ["dense", "moe", "latent_moe"]
DSA_VARIANTS = ["deepseek_v32", "deepseek_v32_yarn", "glm_moe_dsa"]
# 19 tokens: two full Mamba chunks (8) and a remainder; DSA queries past the 6th keep 6 of up to 19 keys.
LOGITS_SHAPE = (2, 19)
# Greedy on one model per family: Mamba + attention + MoE, and MLA + indexer (with a shared-indexer layer) + MoE.
GREEDY_VARIANTS = ["moe", "glm_moe_dsa"]
GREEDY_PROMPT_LENGTHS = [3, 10, 21]  # 21: two prefill steps of 16 and three Mamba chunks
NEW_TOKENS = 8
# One prefill and one decode executable: compiling is most of this test's time. Greedy requests only: warm-up "all"
# compiles no samplers for sampled or logit-adjusting requests (the default warm-up compiles them in the background).
ENGINE_LIMITS = dict(max_batch_size=4, max_seq_len=64, prefill_sizes=[16], decode_sizes=[4], progress=False,
                     warmup="all")


def build_bf16_checkpoint(variant, directory):
    if variant in NEMOTRON_VARIANTS:
        model = make_nemotron_h(variant, **({"moe_intermediate_size": 24} if variant == "moe" else {}))
        # Norm weights away from 1 (make_dsa draws its own): a weight of 1 multiplies exactly, and the cast order
        # around a norm's weight multiply would not show.
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                    weight.copy_(1 + 0.2 * torch.randn(weight.shape, generator=generator))
    else:
        model = make_dsa(variant, moe_intermediate_size=24)
    model.to(torch.bfloat16).save_pretrained(directory)
    return directory


# ---- discrete choices: recorded in call order (layer by layer; indexer before router), optionally pinned ---------


def pinned_router_weights(scores, experts, norm_topk_prob, routed_scaling_factor, xp):
    """The routing weights of given experts: transformers' and our formula, for numpy-like `xp` (jnp or torch)."""
    if xp is torch:
        weights = scores.gather(1, experts)
        total = weights.sum(dim=-1, keepdim=True)
    else:
        weights = jnp.take_along_axis(scores, experts, axis=1)
        total = weights.sum(-1, keepdims=True)
    if norm_topk_prob:
        weights = weights / (total + 1e-20)
    return weights * routed_scaling_factor


@contextlib.contextmanager
def hf_choices(model, pins=None):
    """Record transformers' choices (router experts [N, k], indexer keys [B, S, k]) as [(kind, array)] in call
    order; with `pins` (a list of such arrays), make those choices instead."""
    records, pins = [], None if pins is None else list(pins)

    def on_router(module, args, output):
        logits, weights, experts = output
        if pins is not None:
            experts = torch.as_tensor(pins.pop(0)).to(experts.dtype)
            weights = pinned_router_weights(logits.sigmoid(), experts, module.norm_topk_prob,
                                            module.routed_scaling_factor, torch)
        records.append(("router", experts.numpy().copy()))
        return logits, weights, experts

    def on_indexer(module, args, output):
        if pins is not None:
            output = torch.as_tensor(pins.pop(0)).to(output.dtype)
        records.append(("indexer", output.numpy().copy()))
        return output

    handles = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("TopkRouter"):
            handles.append(module.register_forward_hook(on_router))
        elif name.endswith("Indexer"):
            handles.append(module.register_forward_hook(on_indexer))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def hf_logits(model, input_ids, pins=None):
    """-> (float32 logits, [(kind, choice array)])."""
    with hf_choices(model, pins) as records, torch.no_grad():
        logits = model(torch.as_tensor(input_ids)).logits.float().numpy()
    return logits, records


class OurForward:
    """Our model's cache-free forward, jitted per shape, returning its choices and their scores with the logits:
    router inputs, weights, logits and biases; indexer queries, head weights and keys. With `pins`, every choice is
    the pinned one instead (routing weights recomputed for the pinned experts, as transformers computes them)."""

    def __init__(self, model):
        self.graphdef, self.state = nnx.split(model)
        self.kinds, self.meta = [], []  # per recorded call, fixed by the model's structure
        self._forward = jax.jit(self._traced)

    def _traced(self, state, input_ids, pins):
        records, kinds, meta = [], [], []
        pins = None if pins is None else list(pins)
        original_route, original_select = MoE.route, LightningIndexer.select

        def route(moe, x):
            logits = moe.gate.logits(x)
            if pins is None:
                weights, experts = original_route(moe, x)
            else:
                experts = pins.pop(0)
                weights = pinned_router_weights(jax.nn.sigmoid(logits), experts, moe.norm_topk_prob,
                                                moe.routed_scaling_factor, jnp)
            kinds.append("router")
            meta.append(dict(top_k=moe.top_k, n_group=moe.n_group, topk_group=moe.topk_group))
            records.append(dict(chosen=experts, x=x, w=moe.gate.weight[...], logits=logits,
                                bias=moe.gate.e_score_correction_bias[...]))
            return weights, experts

        def select(indexer, q, weights, k_cache, **kwargs):
            chosen = original_select(indexer, q, weights, k_cache, **kwargs) if pins is None else pins.pop(0)
            kinds.append("indexer")
            meta.append({})
            records.append(dict(chosen=chosen, q=q, weights=weights, keys=k_cache))
            return chosen

        with mock.patch.object(MoE, "route", route), mock.patch.object(LightningIndexer, "select", select):
            logits = nnx.merge(self.graphdef, state)(input_ids)
        self.kinds, self.meta = kinds, meta
        return logits, records

    def __call__(self, input_ids, pins=None):
        """-> (float32 logits, [(kind, record of numpy arrays)])."""
        pins = None if pins is None else [jnp.asarray(p, jnp.int32) for p in pins]
        logits, records = self._forward(self.state, jnp.asarray(input_ids, jnp.int32), pins)
        records = [{key: np.asarray(value, np.float64 if key != "chosen" else np.int64)
                    for key, value in record.items()} for record in records]
        return np.asarray(logits), list(zip(self.kinds, records, self.meta))


def pins_for_ours(hf_records, seq_len):
    """transformers' choices in our layout: indexer keys [B·S, k] with −1 for keys a query cannot see (transformers'
    top-k fills them with arbitrary masked positions, which its causal mask then ignores)."""
    pins = []
    for kind, chosen in hf_records:
        if kind == "indexer":
            chosen = chosen.reshape(-1, chosen.shape[-1])
            positions = np.arange(len(chosen))[:, None] % seq_len
            chosen = np.where(chosen <= positions, chosen, -1)
        pins.append(chosen)
    return pins


def choice_sets(kind, chosen, seq_len):
    """One frozenset per token (router) or query (indexer, visible keys only)."""
    chosen = chosen.reshape(-1, chosen.shape[-1])
    if kind == "router":
        return [frozenset(row.tolist()) for row in chosen]
    positions = np.arange(len(chosen)) % seq_len
    return [frozenset(j for j in row.tolist() if 0 <= j <= pos) for row, pos in zip(chosen, positions)]


def sigmoid(z):
    return 1 / (1 + np.exp(-z))


def kth_margin(scores, k):
    """Per row: k-th largest minus (k+1)-th largest finite score (inf where at most k are finite: no choice)."""
    if scores.shape[-1] <= k:
        return np.full(len(scores), np.inf)
    ranked = -np.sort(-scores, axis=-1)
    with np.errstate(invalid="ignore"):  # -inf - -inf in rows without a choice, replaced below
        return np.where(np.isfinite(scores).sum(-1) > k, ranked[:, k - 1] - ranked[:, k], np.inf)


def router_near_ties(record, meta, noise):
    """(margin, near-tie bound) per token, from our float32 router scores sigmoid(w·x) + b (module docstring)."""
    choice = sigmoid(record["logits"]) + record["bias"]
    tokens, experts = choice.shape
    margin = np.full(tokens, np.inf)
    if meta["n_group"] > 1:
        grouped = choice.reshape(tokens, meta["n_group"], -1)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        # A group scores the sum of two experts, so it moves twice as far: half its margin compares alike.
        margin = kth_margin(group_scores, meta["topk_group"]) / 2
        best = np.argsort(-group_scores, axis=-1)[:, : meta["topk_group"]]
        allowed = np.zeros((tokens, meta["n_group"]), bool)
        np.put_along_axis(allowed, best, True, axis=1)
        choice = np.where(np.repeat(allowed, experts // meta["n_group"], axis=1), choice, -np.inf)
    margin = np.minimum(margin, kth_margin(choice, meta["top_k"]))
    sigma_logit = noise * np.sqrt(np.square(record["x"]) @ np.square(record["w"]).T)  # [tokens, experts]
    return margin, Z * np.sqrt(2) * sigma_logit.max(-1) / 4  # sigmoid's slope is at most 1/4


def indexer_near_ties(record, seq_len, topk, noise):
    """(margin, near-tie bound) per query, from our float32 index scores Σ_h w_h relu(q_h·k) over visible keys."""
    q, weights, keys = record["q"], record["weights"], record["keys"]  # [N, H, D], [N, H], [B, T, D]
    rows, positions = np.divmod(np.arange(len(q)), seq_len)
    visible = np.arange(keys.shape[1])[None] <= positions[:, None]
    dots = np.einsum("nhd,ntd->nht", q, keys[rows])
    scores = np.where(visible, np.einsum("nh,nht->nt", weights, np.maximum(dots, 0)), -np.inf)
    # q and k each move every channel (2·Σ_d q_d²k_d²), w_h moves the head's term (w_h·relu(q_h·k))².
    square_sums = np.einsum("nhd,ntd->nht", np.square(q), np.square(keys[rows]))
    variance = np.einsum("nh,nht->nt", np.square(weights), 2 * square_sums + np.square(np.maximum(dots, 0)))
    sigma = noise * np.sqrt(np.where(visible, variance, 0).max(-1))
    return kth_margin(scores, topk), Z * np.sqrt(2) * sigma


def first_differing_choices(our_records, hf_records, seq_len, *, topk, noise):
    """The first recorded call (in call order) where our choices and transformers' differ, as (kind, [(token,
    margin, near-tie bound)]) for its differing tokens, or None. Every earlier call chose alike, so the inputs of this
    one differ by rounding only; later differences may be consequences of this one and are not judged."""
    assert [kind for kind, _, _ in our_records] == [kind for kind, _ in hf_records]
    for (kind, record, meta), (_, hf_chosen) in zip(our_records, hf_records):
        ours, theirs = choice_sets(kind, record["chosen"], seq_len), choice_sets(kind, hf_chosen, seq_len)
        differing = [t for t, (a, b) in enumerate(zip(ours, theirs)) if a != b]
        if differing:
            if kind == "router":
                margin, tie = router_near_ties(record, meta, noise)
            else:
                margin, tie = indexer_near_ties(record, seq_len, topk, noise)
            return kind, [(t, margin[t], tie[t]) for t in differing]
    return None


# ---- fixtures -----------------------------------------------------------------------------------------------------


def random_ids(vocab_size, shape, seed=0):
    # Ids from 3 up, as in tests/engine/test_llm.py: EOS (2) inside a prompt is legal but blurs the intent.
    return np.random.default_rng(seed).integers(3, vocab_size, size=shape)


@pytest.fixture(scope="module")
def built():
    """Checkpoints, models and pinned logits by variant, built once each: tests of different variant lists
    interleave, and a module-scoped parametrized fixture would rebuild on every switch."""
    return {}


@pytest.fixture
def checkpoint(request, built, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    variant = request.param
    if variant not in built:
        path = build_bf16_checkpoint(variant, tmp_path_factory.mktemp(f"{variant}_bf16"))
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours = OurForward(jaxmodels.load_model(path, dtype="bfloat16", progress=False))
        built[variant] = dict(path=path, theirs=theirs, reference=reference, ours=ours,
                              index_topk=getattr(theirs.config, "index_topk", 0))
    return built[variant]


@pytest.fixture
def pinned(checkpoint):
    """Logits of the float32 reference (its own choices) and of both bf16 runs pinned to those choices, and the
    rounding noise between ours and transformers' bf16 (RMS relative difference of those logits)."""
    if "pinned" not in checkpoint:
        input_ids = random_ids(checkpoint["theirs"].config.vocab_size, LOGITS_SHAPE)
        reference, choices = hf_logits(checkpoint["reference"], input_ids)
        theirs, _ = hf_logits(checkpoint["theirs"], input_ids, pins=[chosen for _, chosen in choices])
        ours, _ = checkpoint["ours"](input_ids, pins=pins_for_ours(choices, LOGITS_SHAPE[1]))
        noise = rms_relative_error(ours, theirs)
        checkpoint["pinned"] = dict(reference=reference, theirs=theirs, ours=ours, noise=noise)
    return checkpoint["pinned"]


ALL_VARIANTS = NEMOTRON_VARIANTS + DSA_VARIANTS
# One per router / indexer code path: latent_moe routes like moe, and the YaRN variant's indexer differs from
# deepseek_v32's by rope frequencies only (its logits tests above still run).
CHOICE_VARIANTS = ["moe", "deepseek_v32", "glm_moe_dsa"]


# ---- logits -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ALL_VARIANTS, indirect=True)
def test_logits_close_to_transformers_bf16(checkpoint, pinned):
    assert pinned["ours"].shape == pinned["theirs"].shape
    assert max_relative_error(pinned["ours"], pinned["theirs"]) < E_ABS


@pytest.mark.parametrize("checkpoint", ALL_VARIANTS, indirect=True)
def test_logits_no_worse_than_transformers_bf16(checkpoint, pinned):
    theirs_error = max_relative_error(pinned["theirs"], pinned["reference"])
    assert max_relative_error(pinned["ours"], pinned["reference"]) <= RATIO * max(theirs_error, U)


def assert_near_ties(first_difference):
    kind, differing = first_difference
    for token, margin, tie in differing:
        assert margin <= tie, f"{kind} choice of token {token}: margin {margin:.3g} > near-tie bound {tie:.3g}"


@pytest.mark.parametrize("checkpoint", CHOICE_VARIANTS, indirect=True)
def test_choices_differ_only_at_near_ties(checkpoint, pinned):
    """Unpinned, our bf16 experts and keys equal transformers' bf16 ones, except where the first call that differs
    (everything before it chose alike) was a near-tie for every token it chose differently."""
    input_ids = random_ids(checkpoint["theirs"].config.vocab_size, LOGITS_SHAPE)
    _, hf_records = hf_logits(checkpoint["theirs"], input_ids)
    _, our_records = checkpoint["ours"](input_ids)
    first = first_differing_choices(our_records, hf_records, LOGITS_SHAPE[1], topk=checkpoint["index_topk"],
                                    noise=pinned["noise"])
    if first is not None:
        assert_near_ties(first)


# ---- greedy tokens through the engine -----------------------------------------------------------------------------


@pytest.fixture
def engine(checkpoint):
    if "engine" not in checkpoint:
        checkpoint["engine"] = jaxmodels.LLM(checkpoint["path"], dtype="bfloat16", **ENGINE_LIMITS)
    return checkpoint["engine"]


def hf_greedy(model, prompt):
    """transformers' greedy tokens and, per generated token, the logits it was chosen from."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float().numpy() for step in out.logits]


def first_divergence(ours, theirs):
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


@pytest.mark.parametrize("checkpoint", GREEDY_VARIANTS, indirect=True)
def test_greedy_tokens_match_transformers_bf16(checkpoint, pinned, engine):
    """Our greedy tokens equal transformers' bf16 greedy tokens, or first differ where transformers' choice was a
    near-tie: either an expert or key choice on the way there (checked as in test_choices_differ_only_at_near_ties,
    on the prompt plus the tokens both generated), or, if ours and transformers' make the same choices there, the
    next token itself: our token's logit within Z·√2·noise·RMS(logits) of transformers' best in the logits
    transformers chose from."""
    vocab_size = checkpoint["theirs"].config.vocab_size
    prompts = [random_ids(vocab_size, (n,), seed=n).tolist() for n in GREEDY_PROMPT_LENGTHS]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0))
    for prompt, out in zip(prompts, outs):
        expected, step_logits = hf_greedy(checkpoint["theirs"], prompt)
        step = first_divergence(out.token_ids, expected)
        if step is None:
            assert out.token_ids == expected, f"prompt of {len(prompt)} tokens"
            continue
        context = np.array([prompt + expected[:step]])
        _, hf_records = hf_logits(checkpoint["theirs"], context)
        _, our_records = checkpoint["ours"](context)
        first = first_differing_choices(our_records, hf_records, context.shape[1], topk=checkpoint["index_topk"],
                                        noise=pinned["noise"])
        if first is not None:
            assert_near_ties(first)
            continue
        logits = step_logits[step]
        gap = logits[expected[step]] - logits[out.token_ids[step]]
        tie = Z * np.sqrt(2) * pinned["noise"] * np.sqrt(np.mean(np.square(logits)))
        assert gap <= tie, f"prompt of {len(prompt)} tokens, token {step}: logit gap {gap:.3g} > near-tie {tie:.3g}"
