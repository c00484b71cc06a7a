"""Mamba2 mixer (Nemotron-H's `M` layers).

in_proj splits into [z | x | B | C | dt]; x‖B‖C goes through a depthwise causal conv with SiLU; the SSD scan runs
with dt = softplus(dt + dt_bias) clamped to the config's `time_step_limit` (default (0, inf): no clamp), A =
-exp(A_log) and the D skip; the output is gated-normed with z and projected back.

The layer works on packed tokens (`cu_seqlens`), the layout of both the kernels and the serving engine; a batch of
equal-length sequences is one such packing.
"""

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels
from jaxmodels.layers.linear import linear
from jaxmodels.layers.norms import GatedGroupRMSNorm
from jaxmodels.step_context import StepContext, StepKind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaCache:
    """One Mamba layer's state pools, indexed by slot: the conv window `conv[num_slots, conv_dim, K-1]` (model dtype)
    and the SSM state `ssm[num_slots, H, P, N]` (float32 unless the config says otherwise)."""

    conv: jax.Array
    ssm: jax.Array
    # Whole on every device of a dp group: the state is per request, so Mamba scales by splitting the batch.
    AXES: ClassVar[dict] = {"conv": ("slot", None, None), "ssm": ("slot", None, None, None)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaVerifyCache:
    """What a verify step leaves of one Mamba layer, for `Mamba2Mixer.commit_verified` (S requests, L tokens each):
    the pools as they were, each request's conv window followed by its L conv inputs (`window[S, C, K-1+L]`), the
    conv output of its L tokens (xbc[S*L, H*P + 2*G*N], x‖B‖C) and in_proj's output, whose dt columns the commit
    reads in place. It lives only inside the verify step's program."""

    conv: jax.Array
    ssm: jax.Array
    window: jax.Array
    xbc: jax.Array
    projected: jax.Array


class DepthwiseConv1d(nnx.Module):
    """Weights of the causal depthwise conv: weight [channels, kernel] (HF stores [channels, 1, kernel])."""

    def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs, bias: bool = True, dtype=jnp.float32):
        self.weight = nnx.Param(nnx.initializers.normal(0.3)(rngs.params(), (channels, kernel), dtype),
                                axes=("mamba", "mamba"))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype), axes=("mamba",)) if bias else None


class Mamba2Mixer(nnx.Module):
    def __init__(self, *, hidden_size: int, num_heads: int, head_dim: int, state_size: int, n_groups: int,
                 conv_kernel: int, chunk_size: int, dt_limit: tuple[float, float], eps: float, rngs: nnx.Rngs,
                 dtype=jnp.float32, conv_bias: bool = True, proj_bias: bool = False):
        self.num_heads, self.head_dim, self.state_size, self.n_groups = num_heads, head_dim, state_size, n_groups
        self.chunk_size, self.dt_limit, self.conv_kernel = chunk_size, tuple(dt_limit), conv_kernel
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.in_proj = linear(hidden_size, self.intermediate + self.conv_dim + num_heads, axes=("embed", "mamba"),
                              rngs=rngs, bias=proj_bias, dtype=dtype)
        self.conv1d = DepthwiseConv1d(self.conv_dim, conv_kernel, rngs=rngs, bias=conv_bias, dtype=dtype)
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, num_heads + 1, dtype=jnp.float32)).astype(dtype),
                               axes=("mamba",))
        self.D = nnx.Param(jnp.ones((num_heads,), dtype), axes=("mamba",))
        self.dt_bias = nnx.Param(jnp.full((num_heads,), math.log(math.expm1(0.01)), dtype), axes=("mamba",))
        self.norm = GatedGroupRMSNorm(self.intermediate, self.intermediate // n_groups, eps, dtype=dtype)
        self.out_proj = linear(self.intermediate, hidden_size, axes=("mamba", "embed"), rngs=rngs, bias=proj_bias,
                               dtype=dtype)

    def cache_shape(self, num_slots: int, dtype, ssm_dtype) -> MambaCache:
        return MambaCache(
            conv=jax.ShapeDtypeStruct((num_slots, self.conv_dim, self.conv_kernel - 1), dtype),
            ssm=jax.ShapeDtypeStruct((num_slots, self.num_heads, self.head_dim, self.state_size), ssm_dtype))

    def forward_packed(self, hidden: jax.Array, cu_seqlens: jax.Array, conv_states=None, ssm_states=None,
                       dt_limit_mask=None):
        """hidden[T,D] packed by `cu_seqlens`[S+1] -> (out[T,D], conv_states[S,C,K-1], ssm_states[S,H,P,N]).

        `dt_limit_mask` (bool[T], optional) applies the `time_step_limit` clamp to the marked tokens only. The serving
        engine needs it when it recomputes a preempted request: transformers clamps dt in its chunked (prompt) path
        but not in its one-token decode path, so tokens that were first decoded must be recomputed unclamped to
        reproduce the same state (it matters only where a config sets a limit other than (0, inf)).
        """
        conv = functools.partial(pallas_kernels.causal_conv1d, initial_states=conv_states)
        gate, conv_states, scan_args = self._packed_scan_inputs(hidden, cu_seqlens, conv, dt_limit_mask)
        y, ssm_states = pallas_kernels.ssd_chunk_scan(**scan_args, initial_states=ssm_states)
        return self._output(y, gate, hidden.dtype), conv_states, ssm_states

    def forward_packed_pooled(self, hidden: jax.Array, cu_seqlens: jax.Array, cache: MambaCache, slot_ids,
                              has_initial_state, dt_limit_mask=None):
        """`forward_packed` with both states read from and written to the slot pools in place:
        -> (out[T,D], MambaCache). Sequence s starts from its pools' rows slot_ids[s] where has_initial_state[s]
        (else from zeros) and leaves its final states there; empty sequences touch nothing, so padding rows cost no
        state traffic (see pallas_kernels.ssd_chunk_scan_pooled and causal_conv1d_pooled)."""
        pools = dict(slot_ids=slot_ids, has_initial_state=has_initial_state)
        conv = functools.partial(pallas_kernels.causal_conv1d_pooled, conv_pool=cache.conv, **pools)
        gate, conv_pool, scan_args = self._packed_scan_inputs(hidden, cu_seqlens, conv, dt_limit_mask)
        y, ssm_pool = pallas_kernels.ssd_chunk_scan_pooled(**scan_args, state_pool=cache.ssm, **pools)
        return self._output(y, gate, hidden.dtype), MambaCache(conv=conv_pool, ssm=ssm_pool)

    def _packed_scan_inputs(self, hidden, cu_seqlens, conv, dt_limit_mask):
        """in_proj and the causal conv of packed tokens -> (gate z, what the conv returns besides its output (final
        states or the updated pool), the scan's arguments but its states). `conv(projected, weight, bias, *,
        cu_seqlens, activation, x_offset, split_at)` is `causal_conv1d` or `causal_conv1d_pooled` with its states
        bound."""
        projected = self.in_proj(hidden)
        gate, _, dt = self._split_projection(projected)
        # The conv reads its x‖B‖C columns of the projection in place and writes x and B‖C as two arrays, as the scan
        # takes them: slices around the kernels would be copy kernels on the GPU (see causal_conv1d's "Packed
        # columns").
        (x, bc), conv_states = conv(projected, self.conv1d.weight[...], self._conv_bias(), cu_seqlens=cu_seqlens,
                                    activation="silu", x_offset=self.intermediate, split_at=self.intermediate)
        dt_args = dict(dt_bias=self.dt_bias[...], dt_softplus=True, dt_limit=self.dt_limit)
        if dt_limit_mask is not None:
            dt = self._softplus_dt(dt)
            dt = jnp.where(dt_limit_mask[:, None], jnp.clip(dt, *self.dt_limit), dt)
            dt_args = dict(dt_bias=None, dt_softplus=False, dt_limit=None)
        x, B, C = self._scan_operands(x, bc)
        return gate, conv_states, dict(x=x, dt=dt, A=self._A(), B=B, C=C, D=self.D[...], cu_seqlens=cu_seqlens,
                                       chunk_size=self.chunk_size, **dt_args)

    def _split_projection(self, projected: jax.Array):
        """in_proj's output split into the gate z, the conv input x‖B‖C and the raw dt."""
        return jnp.split(projected, [self.intermediate, self.intermediate + self.conv_dim], axis=-1)

    def _conv_bias(self):
        return None if self.conv1d.bias is None else self.conv1d.bias[...]

    def _scan_operands(self, x: jax.Array, bc: jax.Array):
        """Conv output, x [n, H*P] and B‖C [n, 2*G*N] -> x [n, H, P], B and C [n, G, N]."""
        n = x.shape[0]
        B, C = jnp.split(bc, 2, axis=-1)
        return (x.reshape(n, self.num_heads, self.head_dim), B.reshape(n, self.n_groups, self.state_size),
                C.reshape(n, self.n_groups, self.state_size))

    def _A(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(jnp.float32))

    def _output(self, y: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        """Gated norm of the scan output [n, H, P] with z, then out_proj."""
        y = self.norm(y.reshape(y.shape[0], self.intermediate), gate)
        return self.out_proj(y.astype(dtype))

    def _softplus_dt(self, dt: jax.Array) -> jax.Array:
        """softplus(dt + dt_bias) in float32, as the kernels compute it before any clamp."""
        return jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))

    def forward_decode(self, hidden: jax.Array, conv_pool: jax.Array, ssm_pool: jax.Array, slot_ids: jax.Array):
        """One token per request: hidden[B,D], state pools indexed by slot_ids[B] -> (out[B,D], conv_pool, ssm_pool).

        No `time_step_limit` clamp here: transformers' recurrent (decode) path applies none, and greedy parity with
        it is the contract. Slot 0 is the null slot of padded requests.
        """
        # The kernels read their pieces of the packed tensors at column offsets (and A from A_log) instead of
        # taking slices: on the GPU each slice would be a copy kernel, five a layer in every decode step.
        projected = self.in_proj(hidden)
        xbc, conv_pool = pallas_kernels.causal_conv1d_update(
            projected, conv_pool, self.conv1d.weight[...], self._conv_bias(), slot_ids=slot_ids, activation="silu",
            x_offset=self.intermediate)
        y, ssm_pool = pallas_kernels.ssd_state_update_packed(
            ssm_pool, xbc, projected, self.A_log[...], n_groups=self.n_groups,
            dt_offset=self._dt_offset, D=self.D[...], dt_bias=self.dt_bias[...], slot_ids=slot_ids,
            dt_softplus=True)
        return self._output(y, projected[:, :self.intermediate], hidden.dtype), conv_pool, ssm_pool

    def forward_verify(self, hidden: jax.Array, step: StepContext, cache: MambaCache):
        """A verify step's L tokens per request, hidden[S*L, D] -> (out[S*L, D], MambaVerifyCache): outputs from
        each slot's state, the pools left as they were (see StepContext's VERIFY). Every token is a generated one, so
        dt has no `time_step_limit` clamp (as in `forward_decode`), and each output is the decode recurrence's
        (pallas_kernels.ssd_verify_scan_packed: the state read once, kept on chip over the L tokens)."""
        slots, num_seqs = step.slot_ids, step.num_seqs
        length = hidden.shape[0] // num_seqs
        projected = self.in_proj(hidden)
        gate, xbc_in, _ = self._split_projection(projected)
        inputs = xbc_in.reshape(num_seqs, length, self.conv_dim).transpose(0, 2, 1).astype(cache.conv.dtype)
        window = jnp.concatenate([cache.conv[slots], inputs], axis=2)
        xbc = pallas_kernels.causal_conv1d_windows(window, self.conv1d.weight[...], self._conv_bias(),
                                                   activation="silu")
        xbc = xbc.reshape(num_seqs * length, self.conv_dim).astype(xbc_in.dtype)
        y = pallas_kernels.ssd_verify_scan_packed(
            cache.ssm, xbc, projected, self.A_log[...], n_groups=self.n_groups, length=length,
            dt_offset=self._dt_offset, D=self.D[...], dt_bias=self.dt_bias[...], slot_ids=slots)
        pending = MambaVerifyCache(conv=cache.conv, ssm=cache.ssm, window=window, xbc=xbc, projected=projected)
        return self._output(y, gate, hidden.dtype), pending

    def commit_verified(self, pending: MambaVerifyCache, slot_ids: jax.Array, accepted: jax.Array) -> MambaCache:
        """Advance each slot by its first accepted[s] + 1 verified tokens (the accepted drafts after the token it
        started from): the conv window ends at that token and the SSM state is the decode recurrence's after it.
        A rejected draft leaves no trace in the pools."""
        keep = self.conv_kernel - 1
        window = jnp.take_along_axis(pending.window, (accepted + 1)[:, None, None] + jnp.arange(keep), axis=2)
        ssm = pallas_kernels.ssd_state_advance_packed(
            pending.ssm, pending.xbc, pending.projected, self.A_log[...], n_groups=self.n_groups,
            length=pending.window.shape[2] - keep, dt_offset=self._dt_offset, dt_bias=self.dt_bias[...],
            slot_ids=slot_ids, lengths=accepted + 1)
        return MambaCache(conv=pending.conv.at[slot_ids].set(window), ssm=ssm)

    @property
    def _dt_offset(self) -> int:
        """dt's first column in in_proj's output (z ‖ x‖B‖C ‖ dt)."""
        return self.intermediate + self.conv_dim

    def __call__(self, hidden: jax.Array, step: StepContext | None = None, cache: MambaCache | None = None):
        """Without a step: full sequences hidden[B, T, D] from zero state -> out[B, T, D], no cache.
        With one: the step's packed tokens hidden[T, D], continuing from and updating their slots' states ->
        (out[T, D], cache)."""
        if step is None:
            batch, seq, dim = hidden.shape
            cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * seq
            out, _, _ = self.forward_packed(hidden.reshape(batch * seq, dim), cu_seqlens)
            return out.reshape(batch, seq, dim)
        if step.is_decode:
            out, conv, ssm = self.forward_decode(hidden, cache.conv, cache.ssm, step.slot_ids)
            return out, MambaCache(conv=conv, ssm=ssm)
        if step.kind is StepKind.VERIFY:
            return self.forward_verify(hidden, step, cache)
        # A request's first chunk starts from zero state, whatever its slot's previous owner left there (no prefix:
        # no initial state). Both pools are updated in place, only on the slots of real sequences.
        # transformers clamps dt to time_step_limit on prompt tokens only (see forward_packed).
        in_prompt = step.positions < step.token_prompt_lens()
        return self.forward_packed_pooled(hidden, step.cu_seqlens, cache, step.slot_ids, step.has_prefix,
                                          dt_limit_mask=in_prompt)
