"""The Mamba2 SSD recurrence on one block of tokens, inside a Triton kernel: the pieces that the scan's kernels share
(`mamba_ssd_pallas`: outputs and final states; `mamba_ssd_segments`: the states that segments hand on).

A block is BT consecutive tokens of one sequence, of which the first `n_valid` are real. With cum = cumsum(dt * A)
over the block's rows:

    y      = ((C Bᵀ) ∘ exp(cum_l - cum_s)[l >= s] ∘ dt_s) x  +  exp(cum) ∘ (C stateᵀ)  +  D x
    state <- exp(cum_last) state + xᵀ (B ∘ exp(cum_last - cum) dt)

Rows past `n_valid` load as zeros and get dt = 0 (no decay, no input), so cum stays flat and cum_last is its value at
the last real token. Products run on `compute_dtype` operands with float32 accumulation.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._mamba_tiles import softplus

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class StepRule:
    """How the raw dt becomes the step of the recurrence, and the operand dtype / precision of the products."""

    dt_softplus: bool
    dt_limit: tuple[float, float] | None
    compute_dtype: object
    precision: object


def dot(a, b, contract, precision):
    """2-D dot_general with float32 accumulation; `contract` = (lhs dim, rhs dim)."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision,
                           preferred_element_type=_f32)


def load_block(x_ref, dt_ref, b_ref, c_ref, *, t0, n_valid, h, g, p0, pmask, nmask, BT, BP, BN):
    """The raw tiles of the BT rows from token t0, rows from `n_valid` on masked to zero: (x[BT, BP], dt[BT],
    B[BT, BN], C[BT, BN] or None without `c_ref`)."""
    rmask = lax.broadcasted_iota(jnp.int32, (BT,), 0) < n_valid
    bn_mask = rmask[:, None] & nmask[None, :]
    x = plgpu.load(x_ref.at[pl.ds(t0, BT), h, pl.ds(p0, BP)], mask=rmask[:, None] & pmask[None, :], other=0.0)
    dt = plgpu.load(dt_ref.at[pl.ds(t0, BT), h], mask=rmask, other=0.0)
    bm = plgpu.load(b_ref.at[pl.ds(t0, BT), g, pl.ds(0, BN)], mask=bn_mask, other=0.0)
    cm = None if c_ref is None else plgpu.load(c_ref.at[pl.ds(t0, BT), g, pl.ds(0, BN)], mask=bn_mask, other=0.0)
    return x, dt, bm, cm


def block_decay(dt_raw, n_valid, a, dt_bias, rule: StepRule):
    """(dt, cum, cum_last): the block's steps (0 from row `n_valid` on), cumsum(dt * A) and its last value."""
    rows = lax.broadcasted_iota(jnp.int32, dt_raw.shape, 0)
    dt = dt_raw.astype(_f32) + dt_bias
    if rule.dt_softplus:
        dt = softplus(dt)
    if rule.dt_limit is not None:
        dt = jnp.clip(dt, rule.dt_limit[0], rule.dt_limit[1])
    dt = jnp.where(rows < n_valid, dt, 0.0)
    cum = lax.cumsum(dt * a, axis=0)
    cum_last = jnp.sum(jnp.where(rows == dt_raw.shape[0] - 1, cum, 0.0))
    return dt, cum, cum_last


def state_input(x, bm, dt, cum, cum_last, rule: StepRule):
    """xᵀ (B ∘ exp(cum_last - cum) dt) [BP, BN]: what the block adds to the state, as of its last row."""
    wb = bm.astype(_f32) * (jnp.exp(cum_last - cum) * dt)[:, None]
    return dot(x.astype(rule.compute_dtype), wb.astype(rule.compute_dtype), (0, 0), rule.precision)


def block_output(x, bm, cm, dt, cum, state, d, rule: StepRule):
    """y [BT, BP] of the block's rows, from the state entering the block."""
    cd = rule.compute_dtype
    rows = lax.broadcasted_iota(jnp.int32, dt.shape, 0)
    causal = rows[:, None] >= rows[None, :]
    cc, xc = cm.astype(cd), x.astype(cd)
    cb = dot(cc, bm.astype(cd), (1, 1), rule.precision)  # [BT, BT]
    scores = cb * jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf)) * dt[None, :]
    y = dot(scores.astype(cd), xc, (1, 0), rule.precision)
    y = y + dot(cc, state.astype(cd), (1, 1), rule.precision) * jnp.exp(cum)[:, None]
    return y + d * x.astype(_f32)


def scan_blocks(num_blocks, load, step, carry, *, prefetch: bool):
    """carry = step(i, load(i), carry) for i < num_blocks, as one loop.

    With `prefetch`, block i + 1's loads are issued before block i's arithmetic and travel in the loop carry, so
    their latency overlaps the block's products instead of opening the next iteration; `load(num_blocks)` is then
    issued too and must be fully masked (rows past a span are).
    """
    if not prefetch:
        return lax.fori_loop(0, num_blocks, lambda i, c: step(i, load(i), c), carry)

    def body(i, c):
        inner, tiles = c
        return step(i, tiles, inner), load(i + 1)

    return lax.fori_loop(0, num_blocks, body, (carry, load(0)))[0]
