"""Exact top-k positions of each row of float32 scores, as a Pallas (Triton) kernel: the selection half of the DSA
indexer (`indexer_topk`), usable on its own (`select_topk_pallas`).

One program per row; no sort. Scores become order-preserving int32 keys (invalid positions: INT_MIN), and:
  a. group maxima: the largest key of each group of G consecutive positions (`gmax`, N/G values), either computed
     by a pass over the row here or handed in by the kernel that wrote the scores (`index_logits_pallas` computes
     them on its tiles, so the indexer never reads a logits row for them);
  b. a lower bound `t_lo` on the k-th largest key: a threshold with at least k group maxima >= t_lo (hence at least
     k keys) and at most `cap_groups` = next_pow2(k) of them, found digit by digit from the top bit (see
     `kth_largest_key`); keys >= t_lo then lie in at most cap_groups groups, so at most G * cap_groups candidates;
  c. compaction, one of two ways (`compaction`):
     - "groups": prefix sums over the group maxima (sub-rows of `compact_lanes`, L2-resident) write the ids of
       the groups with gmax >= t_lo, in order, and their G keys each are gathered from the row into registers;
     - "row": a second pass over the row writes every key >= t_lo (and its position) with a prefix sum per chunk;
       one read of the row and N / chunk dependent prefix sums more than "groups";
  d. the exact k-th largest candidate key T* (the same digit search over the candidates, which stops as soon as
     exactly k candidates are >= its threshold), then one pass writes every candidate > T* and the first ties == T*
     (candidates are in position order, so ties keep the lowest positions, as `lax.top_k` does).
Rows with at most G * cap_groups valid keys skip (a, b): all their keys are candidates. When ties at t_lo put more
than cap_groups groups above it (many equal scores), the row falls back to the same search and emission over the
whole row.

The digit search resolves `digit_bits` bits per counting pass (32 / digit_bits passes at most): one pass counts the
keys >= each of the 2^digit_bits thresholds of the next digit as one [2^b, n] compare-and-sum. Fewer dependent
reductions (each a barrier) but 2^b - 1 times the compares: 4-bit digits cut the passes 4x and multiply the
compares by 15, so they pay only where a pass is dominated by its reduction's latency (measure: `digit_bits`).
With `early_stop` each search ends as soon as the count at its threshold is small enough (exactly k for the cut,
at most cap_groups for the bound): on continuous scores, once the bits decided separate the k-th key from the
next, typically well before the 32nd.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import next_pow2

INT_MIN = -(2**31)
INT_MAX = 2**31 - 1
GROUP = 4  # keys per group maximum: candidates <= GROUP * next_pow2(k)
COMPACTIONS = ("groups", "row")

# Defaults of `select_topk_pallas`. Rows whose group maxima exceed `gmax_in_registers` count them chunk by chunk
# from L2 (a loop of dependent loads per counting pass); LONG_ROW_SELECT_TILES keeps them in registers up to 32768
# group maxima (131072-key rows) with twice the warps, so each thread holds the same 64.
SELECT_TILES = dict(chunk=2048, num_warps=8, num_stages=1, digit_bits=1, compaction="groups", early_stop=True,
                    gmax_in_registers=16384, compact_lanes=4096)
LONG_ROW_SELECT_TILES = dict(SELECT_TILES, num_warps=16, gmax_in_registers=32768)
# When the select computes the group maxima itself (no `gmax` given), the row's keys are in L2 from that pass and
# the second row pass costs less than the candidate gathers: measured on the H200 (`bench/dsa_kernels.py --only
# select`, 4096 x 65536, k = 2048): 2.18 ms with row compaction against 2.76 ms with group compaction. With the
# maxima given (the indexer's fused logits kernel), group compaction: 1.68 ms.
STANDALONE_SELECT_TILES = dict(SELECT_TILES, compaction="row", early_stop=False)


def select_tiles(n_cols: int, group: int = GROUP, *, gmax_given: bool = True) -> dict:
    """Default kernel options for rows of `n_cols` scores, whether or not the group maxima come with them."""
    if n_cols // group > SELECT_TILES["gmax_in_registers"]:
        return dict(LONG_ROW_SELECT_TILES)
    return dict(SELECT_TILES if gmax_given else STANDALONE_SELECT_TILES)


def order_key(x):
    """float32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    u = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(u >= 0, u, u ^ jnp.int32(INT_MAX))


def masked_keys_and_group_max(scores, pos, n_valid, group: int):
    """Order keys of a row segment (INT_MIN at positions >= n_valid) and their maxima over groups of `group`.

    The one definition of `gmax`, shared by the select kernel's own pass and the logits kernel that fuses it."""
    key = jnp.where(pos < n_valid, order_key(scores), INT_MIN)
    return key, jnp.max(key.reshape(key.shape[0] // group, group), axis=1)


def count_ge(keys, thresholds):
    """How many keys are >= each threshold: a scalar threshold gives a scalar, a vector [m] gives counts [m]."""
    if thresholds.ndim == 0:
        return jnp.sum((keys >= thresholds).astype(jnp.int32))
    return jnp.sum((keys[None, :] >= thresholds[:, None]).astype(jnp.int32), axis=1)


def kth_largest_key(count_fn, k, *, digit_bits: int = 1, stop_at=None):
    """A threshold t > INT_MIN with count_fn(t) >= k, found digit by digit from the top bit of the key.

    `count_fn(thresholds)` counts keys >= each threshold (scalar or vector, as `count_ge`). Run to the end, t is the
    k-th largest key (the largest t with count >= k). With `stop_at`, the search returns as soon as
    count_fn(t) <= stop_at: a bound when stop_at > k, and still the exact cut when stop_at = k (then exactly k
    keys are >= t, which is all a top-k emission needs). If fewer than k keys exceed INT_MIN, t = INT_MIN + 1.

    Keys are compared as signed int32; flipping the sign bit maps them in order onto unsigned bit patterns, whose
    digits are decided from the most significant down (`prefix` holds the decided bits).
    """
    if 32 % digit_bits:
        raise ValueError(f"digit_bits must divide 32, got {digit_bits}")
    n_passes = 32 // digit_bits
    digits = jnp.arange(1 << digit_bits, dtype=jnp.int32)

    def running(carry):
        i, _, count = carry
        more = i < n_passes
        return more if stop_at is None else more & (count > stop_at)

    def one_digit(carry):
        # Invariant: count_fn(prefix ^ INT_MIN) >= k (true for prefix = 0, the smallest key, whenever k is met).
        i, prefix, count = carry
        shift = 32 - digit_bits * (i + 1)
        if digit_bits == 1:
            trial = prefix | (jnp.int32(1) << shift)
            c = count_fn(trial ^ INT_MIN)
            ok = c >= k
            return i + 1, jnp.where(ok, trial, prefix), jnp.where(ok, c, count)
        counts = count_fn((prefix | (digits << shift)) ^ INT_MIN)  # non-increasing in the digit
        digit = jnp.sum(((counts >= k) & (digits > 0)).astype(jnp.int32))
        return i + 1, prefix | (digit << shift), jnp.sum(jnp.where(digits == digit, counts, 0))

    _, prefix, _ = lax.while_loop(running, one_digit, (jnp.int32(0), jnp.int32(0), jnp.int32(INT_MAX)))
    return jnp.maximum(prefix ^ INT_MIN, INT_MIN + 1)


def _select_kernel(*refs, n_cols, topk, topk_pad, chunk, group, cap_groups, gmax_in_registers, digit_bits,
                   compaction, early_stop, compact_lanes, gmax_given, interpret):
    if gmax_given:
        lens_ref, logit_ref, gmax_ref, out_ref, *scratch = refs
    else:
        lens_ref, logit_ref, out_ref, gmax_ref, *scratch = refs
    cap = group * cap_groups

    def barrier():
        # Scratch written by some threads of the program is read back by others: order it on the GPU (the
        # interpreter runs a program sequentially and has no barrier primitive).
        if not interpret:
            plgpu.debug_barrier()

    t = pl.program_id(0)
    n_valid = jnp.minimum(lens_ref[t], n_cols)
    k_eff = jnp.minimum(n_valid, topk)
    n_chunks = pl.cdiv(n_valid, chunk)  # chunks past the row's last valid key are never read
    gchunk = chunk // group
    n_groups = n_cols // group
    short = n_valid <= cap  # every valid key is a candidate: no group maxima needed
    out_ref[t, :] = jnp.full((topk_pad,), -1, jnp.int32)

    def row_chunk(c):
        pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return masked_keys_and_group_max(logit_ref[t, pl.ds(c * chunk, chunk)], pos, n_valid, group)[0], pos

    def select(load_chunk, nchunks):
        """Write the k_eff largest keys' positions (ties: lowest positions first) into out_ref[t]."""

        def count(thresholds):
            return lax.fori_loop(0, nchunks, lambda c, n: n + count_ge(load_chunk(c)[0], thresholds),
                                 jnp.zeros(thresholds.shape, jnp.int32))

        thr = kth_largest_key(count, k_eff, digit_bits=digit_bits, stop_at=k_eff if early_stop else None)
        need_ties = k_eff - count(thr + 1)  # keys > thr (thr < INT_MAX whenever k_eff > 0: INT_MAX is a NaN's key)

        def emit(c, carry):
            base, ties = carry
            key, pos = load_chunk(c)
            gt = key > thr
            eq = key == thr
            eq_rank = ties + jnp.cumsum(eq.astype(jnp.int32))
            sel = gt | (eq & (eq_rank <= need_ties))
            slot = base + jnp.cumsum(sel.astype(jnp.int32)) - 1
            slot = jnp.where(sel, slot, topk_pad)  # unselected lanes point past the row (and are masked)
            plgpu.store(out_ref.at[jnp.full(slot.shape, t, jnp.int32), slot], pos, mask=sel)
            return base + jnp.sum(sel.astype(jnp.int32)), ties + jnp.sum(eq.astype(jnp.int32))

        lax.fori_loop(0, nchunks, emit, (jnp.int32(0), jnp.int32(0)))

    # ---- (a, b) group maxima and the bound t_lo, for long rows only
    lane_g = jnp.arange(n_groups, dtype=jnp.int32)
    gmax_fits = n_groups <= gmax_in_registers and not n_groups & (n_groups - 1)

    def gmax_chunk(c, size=gchunk):
        return gmax_ref[t, pl.ds(c * size, size)], c * size + jnp.arange(size, dtype=jnp.int32)

    def gmax_whole():
        return plgpu.load(gmax_ref.at[t, pl.ds(0, n_groups)], mask=lane_g * group < n_valid, other=INT_MIN)

    def bound():
        if not gmax_given:
            def store_gmax(c, carry):
                key, pos = row_chunk(c)
                gmax_ref[t, pl.ds(c * gchunk, gchunk)] = jnp.max(key.reshape(gchunk, group), axis=1)
                return carry

            lax.fori_loop(0, n_chunks, store_gmax, None)
            barrier()
        if gmax_fits:
            # The whole row of group maxima in registers: the counting passes touch no memory (a loop over
            # L2-resident chunks is bound by load latency, one dependent load + reduction per step).
            g = gmax_whole()
            count = functools.partial(count_ge, g)
        else:
            def count(thresholds):
                return lax.fori_loop(0, n_chunks, lambda c, n: n + count_ge(gmax_chunk(c)[0], thresholds),
                                     jnp.zeros(thresholds.shape, jnp.int32))
        return kth_largest_key(count, k_eff, digit_bits=digit_bits, stop_at=cap_groups if early_stop else None)

    # (The short branch derives its constant from n_valid: Triton's cond lowering needs an IR value to yield.)
    t_lo = lax.cond(short, lambda: n_valid * 0 + (INT_MIN + 1), bound)

    # ---- (c) compaction and (d) the exact selection
    if compaction == "groups":
        (gid_ref,) = scratch

        def write_group_ids(gmax, gids, base):
            # (The mask matters for maxima this kernel wrote: its pass stops at the row's last valid chunk, so a
            # sub-row reaching past it reads scratch never written.)
            cand = (gmax >= t_lo) & (gids * group < n_valid)
            slot = base + jnp.cumsum(cand.astype(jnp.int32)) - 1
            keep = cand & (slot < cap_groups)
            slot = jnp.where(keep, slot, cap_groups)
            plgpu.store(gid_ref.at[jnp.full(slot.shape, t, jnp.int32), slot], gids, mask=keep)
            return base + jnp.sum(cand.astype(jnp.int32))

        def compact_groups():
            # Prefix sums over sub-rows of `compact_lanes` group maxima re-read from L2: one prefix sum over all
            # of them in registers would hold four values per group at once (the program's register peak).
            size = min(compact_lanes, n_groups) if gmax_fits else gchunk
            steps = pl.cdiv(n_valid, size * group)
            return lax.fori_loop(0, steps, lambda c, base: write_group_ids(*gmax_chunk(c, size), base),
                                 jnp.int32(0))

        n_cand_groups = lax.cond(short, lambda: pl.cdiv(n_valid, group), compact_groups)
        barrier()

        @pl.when(n_cand_groups <= cap_groups)
        def _candidates_in_registers():
            lane = jnp.arange(cap, dtype=jnp.int32)
            slot = lane // group
            listed = slot < n_cand_groups
            # Short rows take their groups in order; long rows read the ids written above.
            gid = jnp.where(short, slot, plgpu.load(gid_ref.at[jnp.full(slot.shape, t, jnp.int32), slot],
                                                    mask=listed & jnp.logical_not(short), other=0))
            pos = gid * group + lane % group
            valid = listed & (pos < n_valid)
            scores = plgpu.load(logit_ref.at[jnp.full(pos.shape, t, jnp.int32), pos], mask=valid, other=0.0)
            key = jnp.where(valid, order_key(scores), INT_MIN)
            select(lambda c: (key, pos), 1)

        @pl.when(n_cand_groups > cap_groups)
        def _whole_row():
            select(row_chunk, n_chunks)
    else:
        ckey_ref, cidx_ref = scratch

        def compact_keys(c, base):
            key, pos = row_chunk(c)
            cand = key >= t_lo
            slot = base + jnp.cumsum(cand.astype(jnp.int32)) - 1
            keep = cand & (slot < cap)
            slot = jnp.where(keep, slot, cap)
            rows = jnp.full(slot.shape, t, jnp.int32)
            plgpu.store(ckey_ref.at[rows, slot], key, mask=keep)
            plgpu.store(cidx_ref.at[rows, slot], pos, mask=keep)
            return base + jnp.sum(cand.astype(jnp.int32))

        total = lax.fori_loop(0, n_chunks, compact_keys, jnp.int32(0))
        barrier()

        @pl.when(total <= cap)
        def _candidates_in_registers():
            lane = jnp.arange(cap, dtype=jnp.int32)
            ckey = jnp.where(lane < total, ckey_ref[t, :], INT_MIN)
            cidx = cidx_ref[t, :]
            select(lambda c: (ckey, cidx), 1)

        @pl.when(total > cap)
        def _whole_row():
            select(row_chunk, n_chunks)


def select_topk_pallas(logits, kv_lens, topk: int, *, gmax=None, group: int = GROUP, n_rows: int | None = None,
                       chunk: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                       gmax_in_registers: int | None = None, digit_bits: int | None = None,
                       compaction: str | None = None, early_stop: bool | None = None, compact_lanes: int | None = None,
                       interpret: bool = False):
    """Exact top-k positions of each row of float32 logits [R, N] among its first kv_lens[r] entries -> [n_rows,
    topk] int32, −1 padded, in no particular order. N must be a multiple of `chunk` (a power of two; shorter rows
    use one chunk). `gmax` [R, N / group] int32: the rows' group maxima as `masked_keys_and_group_max` defines them,
    when the caller has them (the row pass that would compute them is skipped). Options left None take
    `select_tiles(N)`."""
    R, N = logits.shape
    n_rows = R if n_rows is None else n_rows
    opts = select_tiles(N, group, gmax_given=gmax is not None)
    for name, value in dict(chunk=chunk, num_warps=num_warps, num_stages=num_stages,
                            gmax_in_registers=gmax_in_registers, digit_bits=digit_bits,
                            compaction=compaction, early_stop=early_stop, compact_lanes=compact_lanes).items():
        if value is not None:
            opts[name] = value
    chunk = min(opts["chunk"], N)
    if N % chunk or chunk & (chunk - 1) or chunk < group:
        raise ValueError(f"row length {N} must be a multiple of a power-of-two chunk {chunk} >= {group}")
    if opts["compaction"] not in COMPACTIONS:
        raise ValueError(f"compaction must be one of {COMPACTIONS}, got {opts['compaction']!r}")
    if gmax is not None and gmax.shape != (R, N // group):
        raise ValueError(f"gmax must be [{R}, {N // group}] (group maxima of groups of {group}), got {gmax.shape}")
    topk_pad = next_pow2(topk)
    cap_groups = topk_pad
    cap = group * cap_groups
    kernel = functools.partial(
        _select_kernel, n_cols=N, topk=topk, topk_pad=topk_pad, chunk=chunk, group=group, cap_groups=cap_groups,
        gmax_in_registers=opts["gmax_in_registers"], digit_bits=opts["digit_bits"], compaction=opts["compaction"],
        early_stop=opts["early_stop"], compact_lanes=opts["compact_lanes"], gmax_given=gmax is not None,
        interpret=interpret)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    out_shapes = [i32((n_rows, topk_pad))]
    if gmax is None:
        out_shapes.append(i32((n_rows, N // group)))  # scratch: group maxima
    if opts["compaction"] == "groups":
        out_shapes.append(i32((n_rows, cap_groups)))  # scratch: ids of the candidate groups
    else:
        out_shapes += [i32((n_rows, cap)), i32((n_rows, cap))]  # scratch: candidate keys and positions
    inputs = [kv_lens.astype(jnp.int32), logits] + ([] if gmax is None else [gmax])
    out, *_ = pl.pallas_call(
        kernel,
        grid=(n_rows,),
        out_shape=tuple(out_shapes),
        compiler_params=plgpu.CompilerParams(num_warps=opts["num_warps"], num_stages=opts["num_stages"]),
        interpret=interpret,
        name="select_topk",
    )(*inputs)
    return out if topk_pad == topk else out[:, :topk]
