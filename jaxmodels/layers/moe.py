"""Mixture of experts with DeepSeek-style routing, shared by Nemotron-H (`E` layers) and the DSA models.

Routing: sigmoid scores; `e_score_correction_bias` is added for *selection only*; experts are chosen inside the
`topk_group` best of `n_group` groups (a group scores as the sum of its two best experts); the chosen experts'
unbiased scores are optionally renormalized and then multiplied by `routed_scaling_factor`.

Experts run as two grouped matmuls over the tokens sorted by expert (`pallas_kernels.grouped_matmul`, or for an FP8
checkpoint's experts `Fp8ExpertStack`, its FP8 counterpart). A step with few (token, expert) pairs, as decode has,
finds each pair's sorted position by counting instead of sorting (`expert_ranks`; unless
JAXMODELS_DECODE_FUSIONS=0, see decode_fusions); such a step also runs the shared expert as more experts of the same
grouped matmuls (`MoE.shared_rides_with_experts`; JAXMODELS_SHARED_EXPERT_IN_GMM=0 keeps it beside them).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels
from jaxmodels.layers import decode_fusions
from jaxmodels.layers.fp8_linear import Fp8ExpertStack
from jaxmodels.layers.group_parallel import across_groups, sum_over
from jaxmodels.layers.linear import ACTIVATIONS, linear
from jaxmodels.layers.mlp import MLP, GatedMLP
from jaxmodels.layers.tensor_parallel import TP, compiler_tp_size, manual_over_tp, module_over_tp
from pallas_kernels.grouped_matmul import ExtraExperts


def grouped_topk_routing(logits, correction_bias, *, top_k: int, n_group: int, topk_group: int,
                         norm_topk_prob: bool, routed_scaling_factor: float,
                         excluded_group_score: float = -jnp.inf):
    """Pick `top_k` experts per token. logits[N,E] float32 -> (weights[N,k] float32, experts[N,k] int32).

    `excluded_group_score` is what experts outside the chosen groups score during selection: transformers' Nemotron-H
    uses -inf, its DeepSeek-V3 family 0.0 (they differ when biased scores can be negative).
    """
    num_tokens, num_experts = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + correction_bias
    if n_group > 1:
        grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_scores, topk_group)
        group_mask = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        expert_mask = jnp.repeat(group_mask, num_experts // n_group, axis=1)
        choice = jnp.where(expert_mask, choice, excluded_group_score)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, experts.astype(jnp.int32)


class TopkRouter(nnx.Module):
    """Router weights stay float32 whatever the model dtype (transformers keeps them so too)."""

    def __init__(self, hidden_size: int, num_experts: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (num_experts, hidden_size), jnp.float32),
                                axes=("router_expert", "embed"))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32), axes=("router_expert",))

    def logits(self, x: jax.Array) -> jax.Array:
        # Full float32 whatever the model's matmul precision: expert choice flips on small score differences.
        return jnp.dot(x.astype(jnp.float32), self.weight[...].T, precision=jax.lax.Precision.HIGHEST)


# Up to this many (token, expert) pairs, a step ranks them by counting (see expert_ranks): a decode step's 1-4096
# pairs; a prefill chunk's tens of thousands sort.
RANK_BY_COUNTING = 4096
# A step may run the shared expert inside the routed experts' grouped matmuls (MoE.shared_rides_with_experts) while
# its pieces' rows (tokens x pieces, the first rows of the sorted ones) fit in one row tile of the kernel (16 rows,
# its smallest, which it takes at decode): then each piece's weights are read once, as its own GEMM reads them; a
# piece across two tiles would read them twice.
SHARED_IN_GROUPED_MAX_ROWS = 16


def sort_by_expert(experts: jax.Array, num_experts: int):
    """Order of the (token, slot) pairs sorted by expert, and each expert's row count."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def expert_ranks(experts: jax.Array, num_experts: int):
    """Each (token, slot) pair's position in the pairs stably sorted by expert, and each expert's row count:
    rank[p] = the pairs of a smaller expert plus the earlier pairs of the same one (the inverse of `sort_by_expert`'s
    order). R² comparisons for R pairs, but each result one fused reduction: on the GPU the sort, the histogram and
    the gathers and scatter-add through the order are a dozen small kernels, most of a one-sequence MoE layer's."""
    flat = experts.reshape(-1)
    p = jnp.arange(flat.shape[0])
    before = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (p[None, :] < p[:, None]))
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)
    group_sizes = jnp.sum(flat[None, :] == jnp.arange(num_experts)[:, None], axis=1, dtype=jnp.int32)
    return rank, group_sizes


def _weighted_sum(sorted_out: jax.Array, rank: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Expert outputs in sorted order [R, D], pair p's row at rank[p], routing weights [N, k] -> the weighted sum over
    each token's k pairs [N, D]: weighting and sum in float32, in slot order, as transformers accumulates them."""
    num_tokens, top_k = weights.shape
    out = sorted_out[rank].reshape(num_tokens, top_k, sorted_out.shape[-1]).astype(jnp.float32)
    return jnp.sum(out * weights[..., None], axis=1).astype(dtype)


def _held_stack_shape(weights) -> tuple[int, int, int]:
    """(experts, in, out) this device holds of a projection stack: dense [E, in, out], or FP8 [E, out, in]."""
    if isinstance(weights, Fp8ExpertStack):
        experts, fan_out, fan_in = weights.weight.shape
        return experts, fan_in, fan_out
    return tuple(weights.shape)


def _grouped(weights, rows: jax.Array, group_sizes: jax.Array, activation: str | None = None,
             extra: ExtraExperts | None = None) -> jax.Array:
    """rows through the stacked experts (after the `extra` ones, groups 0 .. S-1, when given), then `activation`
    (inside the grouped matmul where it has it as an epilogue, saving the activation's own pass)."""
    if isinstance(weights, Fp8ExpertStack):
        out = weights(rows, group_sizes)
    elif decode_fusions.ENABLED and activation in pallas_kernels.grouped_matmul_epilogues:
        return pallas_kernels.grouped_matmul(rows, weights[...], group_sizes, epilogue=activation, extra=extra)
    else:
        out = pallas_kernels.grouped_matmul(rows, weights[...], group_sizes, extra=extra)
    return out if activation is None else ACTIVATIONS[activation](out)


def _shared_as_experts(shared: nnx.Module) -> dict[str, ExtraExperts]:
    """A dense MLP's projections as extra experts of a routed stack (see grouped_matmul.ExtraExperts): the up (and
    gate) projections cut along their output columns, the down projection along its input rows."""
    cuts = {"up_proj": "n", "down_proj": "k"}
    if isinstance(shared, GatedMLP):
        cuts["gate_proj"] = "n"
    return {name: ExtraExperts(getattr(shared, name).kernel[...], split) for name, split in cuts.items()}


class RoutedExperts(nnx.Module):
    """`num_experts` MLPs stored stacked: up_proj [E, in, inter] (gate_proj too when gated), down_proj [E, inter, in],
    or each an `Fp8ExpertStack` when an FP8 checkpoint's experts stay FP8 (jaxmodels.quantization swaps them in).

    Non-gated: `down(act(up(x)))` (Nemotron-H, relu²). Gated: `down(act(gate(x)) * up(x))` (DeepSeek, SiLU).
    """

    def __init__(self, num_experts: int, in_dim: int, intermediate: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 activation: str = "relu2", gated: bool = False):
        init = nnx.initializers.normal(0.02)
        self.num_experts, self.activation, self.gated = num_experts, activation, gated
        self.intermediate = intermediate
        up_axes, down_axes = ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed")
        if gated:
            self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, in_dim, intermediate), dtype), axes=up_axes)
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, in_dim, intermediate), dtype), axes=up_axes)
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, intermediate, in_dim), dtype), axes=down_axes)

    def projections(self) -> tuple[str, ...]:
        """The attribute names of the projection stacks."""
        return ("gate_proj", "up_proj", "down_proj") if self.gated else ("up_proj", "down_proj")

    def held_experts(self) -> int:
        """How many experts this group holds: all of them, or its slice when the experts are split over dp groups
        (see group_parallel)."""
        return _held_stack_shape(self.up_proj)[0]

    def is_split(self) -> bool:
        return self.held_experts() < self.num_experts or _held_stack_shape(self.up_proj)[2] < self.intermediate

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array, first_expert=0,
                 shared: nnx.Module | None = None) -> jax.Array:
        """x[N,D], routing weights/experts [N,k] -> sum over the k experts of weight * expert(x), [N,D].

        With a slice of the experts (first_expert .. first_expert + held_experts() - 1), the sum covers those only:
        the other choices sort into one extra group past the held ones, whose rows the grouped matmul leaves zero.
        `shared`, an MLP the caller found fit (`MoE.shared_rides_with_experts`), runs as S more experts that every
        token takes with weight 1, and its output joins the sum.
        """
        num_tokens, top_k = experts.shape
        held = self.held_experts()
        extras = _shared_as_experts(shared) if shared is not None else {}
        pieces = shared.intermediate_size // self.intermediate if shared is not None else 0
        local = experts - first_expert
        # The shared expert's pieces are groups 0 .. pieces-1 (see grouped_matmul.ExtraExperts), the held experts
        # the groups after them, and choices of no held expert one group past those.
        local = jnp.where((local >= 0) & (local < held), local + pieces if pieces else local, held + pieces)
        width = x.shape[-1]
        counting = decode_fusions.ENABLED and num_tokens * (top_k + pieces) <= RANK_BY_COUNTING
        if pieces:
            if not counting:
                raise ValueError("a shared expert rides with the routed ones only in a step ranked by counting")
            local = jnp.concatenate([local, jnp.broadcast_to(jnp.arange(pieces, dtype=local.dtype),
                                                             (num_tokens, pieces))], axis=1)
            weights = jnp.concatenate([weights, jnp.ones((num_tokens, pieces), weights.dtype)], axis=1)
            top_k += pieces
        if counting:
            rank, group_sizes = expert_ranks(local, held + pieces)
            # Row rank[p] of the sorted rows is pair p's token; every pair owns one row (rank is a permutation).
            pairs = jnp.broadcast_to(x[:, None, :], (num_tokens, top_k, width)).reshape(-1, width)
            rows = jnp.zeros_like(pairs).at[rank].set(pairs, unique_indices=True)
            return _weighted_sum(self._expert_mlp(rows, group_sizes, extras), rank, weights, x.dtype)
        order, group_sizes = sort_by_expert(local, held + 1)
        out = self._expert_mlp(x[order // top_k], group_sizes[:held])
        # Back to the pairs' order through the inverse permutation, a gather: scatter-adding the rows into their
        # tokens instead took 0.34 ms a layer of the Nano-30B class's 8192-token prefill on the H200 (atomics).
        rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
        return _weighted_sum(out, rank, weights, x.dtype)

    def _expert_mlp(self, rows: jax.Array, group_sizes: jax.Array, extras: dict | None = None) -> jax.Array:
        """Rows sorted by expert (group_sizes[e] rows of expert e, then rows of no held expert) -> each row through
        its expert's MLP; rows past the groups come out zero. `extras`: each projection's ExtraExperts, the groups
        before the held experts'."""
        extras = extras or {}
        if self.gated:
            hidden = _grouped(self.gate_proj, rows, group_sizes, self.activation, extras.get("gate_proj")) * _grouped(
                self.up_proj, rows, group_sizes, extra=extras.get("up_proj"))
        else:
            hidden = _grouped(self.up_proj, rows, group_sizes, self.activation, extras.get("up_proj"))
        return _grouped(self.down_proj, hidden, group_sizes, extra=extras.get("down_proj"))


class MoE(nnx.Module):
    """Routed experts (optionally inside a latent projection) plus one always-on shared expert."""

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, expert_intermediate: int,
                 shared_intermediate: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 routed_scaling_factor: float, rngs: nnx.Rngs, dtype=jnp.float32, activation: str = "relu2",
                 gated: bool = False, latent_size: int | None = None, shared_expert: nnx.Module | None = None,
                 excluded_group_score: float = -jnp.inf):
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.excluded_group_score = excluded_group_score
        self.gate = TopkRouter(hidden_size, num_experts, rngs=rngs)
        expert_dim = latent_size or hidden_size
        self.experts = RoutedExperts(num_experts, expert_dim, expert_intermediate, rngs=rngs, dtype=dtype,
                                     activation=activation, gated=gated)
        self.latent_size = latent_size
        if latent_size is not None:
            self.fc1_latent_proj = linear(hidden_size, latent_size, axes=("embed", "latent"), rngs=rngs, dtype=dtype)
            self.fc2_latent_proj = linear(latent_size, hidden_size, axes=("latent", "embed"), rngs=rngs, dtype=dtype)
        self.shared_experts = shared_expert or MLP(hidden_size, shared_intermediate, rngs=rngs, dtype=dtype,
                                                   activation=activation)

    def route(self, x: jax.Array):
        return grouped_topk_routing(
            self.gate.logits(x), self.gate.e_score_correction_bias[...], top_k=self.top_k, n_group=self.n_group,
            topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, excluded_group_score=self.excluded_group_score)

    def routed(self, x: jax.Array, dp_axis: str | None = None, shared: nnx.Module | None = None) -> jax.Array:
        """The routed experts' sum for tokens x[..., D] (this group's slice of the experts when they are split),
        with the `shared` expert's output in it when given (see shared_rides_with_experts)."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = self.route(tokens)
        routed_in = self.fc1_latent_proj(tokens) if self.latent_size is not None else tokens
        if shared is not None:
            return self.experts(routed_in, weights, experts, shared=shared).reshape(shape)
        routed = self._experts_sum(routed_in, weights, experts, dp_axis)
        if self.latent_size is not None:
            routed = self.fc2_latent_proj(routed)  # linear without bias: a partial sum stays one
        return routed.reshape(shape)

    def _experts_sum(self, x: jax.Array, weights: jax.Array, experts: jax.Array, dp_axis: str | None) -> jax.Array:
        """The routed experts' sum over this group's (or device's) experts. Where the compiler splits the expert
        stacks over "tp", the grouped matmuls, custom calls, run manual over "tp": each device its own experts (or
        its slice of each expert's intermediate dimension), then a sum over "tp" (see tensor_parallel)."""
        tp = compiler_tp_size()
        if tp > 1:
            arrays, specs, rebuild = module_over_tp(self.experts)
            if any(TP in spec for spec in specs):
                def local(local_arrays, x, weights, experts):
                    mine = rebuild(local_arrays)
                    return sum_over(mine(x, weights, experts, self._first_expert(mine, dp_axis, tp)), TP)

                return manual_over_tp(local, (specs, P(), P(), P()), P())(arrays, x, weights, experts)
        return self.experts(x, weights, experts, self._first_expert(self.experts, dp_axis))

    @staticmethod
    def _first_expert(experts: RoutedExperts, dp_axis: str | None, tp: int = 1):
        """The first of the experts held here. The rules split the expert axis over ("dp", "tp") in that order, so
        the holder's index is dp index * tp + tp index (tp > 1 only manual over "tp"); 0 where every expert is held
        (each with a slice of its intermediate dimension, or whole)."""
        held = experts.held_experts()
        if held == experts.num_experts:
            return 0
        index = jax.lax.axis_index(dp_axis) if dp_axis is not None else 0
        if tp > 1:
            index = index * tp + jax.lax.axis_index(TP)
        return index * held

    def shared_rides_with_experts(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs the shared expert inside the routed experts' grouped matmuls
        (unless JAXMODELS_SHARED_EXPERT_IN_GMM=0, see decode_fusions): a decode step whose tokens times the shared
        expert's pieces are at most SHARED_IN_GROUPED_MAX_ROWS (ranked by counting), on whole weights (nothing split
        over dp groups or "tp", no FP8 stacks, no latent projection in front of the experts), and a shared MLP of
        the experts' kind, without biases, whose intermediate size is a multiple of theirs."""
        shared, experts = self.shared_experts, self.experts
        if not (decode_fusions.SHARED_EXPERT_IN_GMM and decode_fusions.ENABLED) or self.latent_size is not None:
            return False
        if not isinstance(shared, (MLP, GatedMLP)) or isinstance(shared, GatedMLP) != experts.gated:
            return False
        if shared.activation != experts.activation or shared.intermediate_size % experts.intermediate:
            return False
        pieces = shared.intermediate_size // experts.intermediate
        if num_tokens * pieces > SHARED_IN_GROUPED_MAX_ROWS or num_tokens * (self.top_k + pieces) > RANK_BY_COUNTING:
            return False
        if compiler_tp_size() > 1:
            return False
        projections = [getattr(shared, name) for name in experts.projections()]
        if any(not isinstance(p, nnx.Linear) or p.bias is not None for p in projections):
            return False  # (an FP8 checkpoint's shared expert)
        if any(isinstance(getattr(experts, name), Fp8ExpertStack) for name in experts.projections()):
            return False
        return not (experts.is_split() or shared.is_split())

    def __call__(self, x: jax.Array, dp_axis: str | None = None) -> jax.Array:
        if self.shared_rides_with_experts(math.prod(x.shape[:-1])):
            return self.routed(x, dp_axis, shared=self.shared_experts)
        return across_groups(x, dp_axis, [(lambda t: self.routed(t, dp_axis), self.experts.is_split()),
                                          (self.shared_experts.forward, self.shared_experts.is_split())])
