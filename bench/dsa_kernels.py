"""DSA / MoE kernels on the GPU: correctness (`--check`) then timings, each kernel beside its XLA reference and the
floor (bytes at 4.25 TB/s or FLOPs at 810 TFLOP/s, the H200 ceilings measured in ../shared/DESIGN.md).

    PYTHONPATH=. python bench/dsa_kernels.py --check [--quick] [--log $OUT/dsa.log]
    PYTHONPATH=. python bench/dsa_kernels.py --check --only select,mla_decode            # issue 14: select, decode
    PYTHONPATH=. python bench/dsa_kernels.py --only indexer --indexer-kinds decode --ctx 131072
    PYTHONPATH=. python bench/dsa_kernels.py --check --only mla_decode   # the Mosaic and the Triton kernel

Rows marked OLD run the kernels with the options that reproduce their pre-issue-14 algorithm (OLD_SELECT,
OLD_INDEXER, OLD_MLA); `{}` rows run the defaults.

Times: jitted call issued `n` times back to back then one block_until_ready, divided by n; median of 5 rounds. Rows
whose floor is under DISPATCH_BOUND_S (one query: the host's dispatch of a call would be what they time) run the op
over several operand sets in one executable and report the time per op (`timed`, `sets_for`).
Prints one table per section; the last line is the headline.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmodels.benchmark_floors import BF16_PEAK, COPY_BANDWIDTH  # the H200's measured ceilings
from kernel_report import DISPATCH_BOUND_S, ROWS, copies_for, in_one_graph, open_log, say, section, timeit
from pallas_kernels.grouped_matmul import grouped_matmul_pallas, grouped_matmul_reference
from pallas_kernels.indexer_topk import (index_logits_pallas, index_logits_reference, indexer_topk_pallas,
                                         quantize_index_k_fp8, topk_reference)
from pallas_kernels._mosaic import mosaic_kernels_available
from pallas_kernels.sparse_mla_attention import sparse_mla_attention_pallas, sparse_mla_attention_reference
from pallas_kernels.sparse_mla_mosaic import decode_splits, schedule_for, sparse_mla_decode_mosaic
from pallas_kernels.topk_select import GROUP, masked_keys_and_group_max, select_topk_pallas

CTXS = [8192, 32768, 131072]
INDEXER_KINDS = ["decode", "prefill"]
MLA_BATCHES = [1, 32, 128]
# Whether the sparse MLA sections check and time the Mosaic GPU kernel too: set by main() where this jax runs it
# (--no-mosaic: not).
MOSAIC_MLA = False

# The kernels as they were before the decode splits and the group compaction (issue 14), for side-by-side rows:
# the select with a second pass over the row and 32 + 32 fixed counting passes, its own group-maxima pass, the
# 8-warp tiles at every row length; sparse MLA with one program per (query, head block) over the whole list.
OLD_SELECT = dict(compaction="row", early_stop=False, num_warps=8, gmax_in_registers=16384)
OLD_INDEXER = dict(OLD_SELECT, fuse_group_max=False)
OLD_MLA = dict(num_splits=1, trim=False)


def label(opts):
    return "{" + ", ".join(f"{k}={v}" for k, v in opts.items()) + "}"


def group_maxima(x, lens, group=GROUP):
    """What the indexer's logits kernel hands the select (here computed by XLA, outside the timed call)."""
    pos = jnp.arange(x.shape[1], dtype=jnp.int32)
    return jax.vmap(lambda row, n: masked_keys_and_group_max(row, pos, n, group)[1])(x, lens)


def torch_topk_seconds(x, k):
    """torch.topk on the same device array (through DLPack), or None without torch / CUDA."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        xt = torch.utils.dlpack.from_dlpack(x)
        torch.topk(xt, k, dim=1)
        torch.cuda.synchronize()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                torch.topk(xt, k, dim=1)
            torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t0) / 10)
        return float(np.median(rounds))
    except Exception as e:  # noqa: BLE001 (a comparator only: report and go on)
        say(f"  torch.topk not timed: {e!r}")
        return None

def row(name, t_kernel, t_ref, floor_s, note=""):
    """One result line; t_ref None when the reference is not timed (too slow or too big at that size)."""
    ref = f"ref {t_ref * 1e3:9.3f} ms  x{t_ref / t_kernel:6.1f}" if t_ref is not None else f"{'ref -':>25}"
    line = (f"{name:<44} {t_kernel * 1e3:9.3f} ms  {ref}  "
            f"floor {floor_s * 1e3:8.3f} ms  {100 * floor_s / t_kernel:5.1f}% of floor  {note}")
    ROWS.append(line)
    say(line)




# ------------------------------------------------------------------------------------------------- checks

def topk_errors(idx, scores, kv_lens, topk, tol):
    idx, scores, kv_lens = np.asarray(idx), np.asarray(scores, np.float64), np.asarray(kv_lens)
    bad = 0
    for t in range(idx.shape[0]):
        n_valid = min(int(kv_lens[t]), scores.shape[1])
        k_eff = min(topk, n_valid)
        r = idx[t]
        sel = r[:k_eff]
        ok = (r[k_eff:] == -1).all() and ((sel >= 0) & (sel < n_valid)).all() and len(set(sel.tolist())) == k_eff
        if ok and k_eff:
            v = scores[t, :n_valid]
            kth = np.sort(v)[::-1][k_eff - 1]
            ok = (v[sel] >= kth - tol).all() and set(np.nonzero(v > kth + tol)[0].tolist()) <= set(sel.tolist())
        bad += not ok
    return bad


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@section
def check_select():
    key = jax.random.key(0)
    T, N, k = 64, 65536, 2048
    x = jax.random.normal(key, (T, N))
    lens = jax.random.randint(jax.random.key(1), (T,), 0, N + 1).at[:6].set(jnp.array([N, 1, 0, 100, 2048, 9000]))
    for name, xx in [("random", x), ("ties", jnp.round(x * 2))]:
        masked = jnp.where(jnp.arange(N) < lens[:, None], xx, -jnp.inf)
        ref = topk_reference(masked, lens, k)
        gmax = group_maxima(xx, lens)
        for opts in [dict(), OLD_SELECT, dict(digit_bits=4), dict(num_warps=16), dict(gmax=gmax)]:
            got = jax.jit(functools.partial(select_topk_pallas, topk=k, **opts))(xx, lens)
            same = sum(set(np.asarray(got[t]).tolist()) == set(np.asarray(ref[t]).tolist()) for t in range(T))
            bad = topk_errors(got, masked, lens, k, 0.0)
            say(f"check select_topk {name} {label({o: v for o, v in opts.items() if o != 'gmax'})}"
                f"{' gmax given' if 'gmax' in opts else ''}: rows equal as sets {same}/{T}, invalid rows {bad}")
            assert bad == 0


def paged_problem(key, T, S, ctx, Hi=64, D=128, page_size=64, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 4)
    max_pages = ctx // page_size
    num_pages = S * max_pages + 1
    q = jax.random.normal(ks[0], (T, Hi, D), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[1], (T, Hi), jnp.float32) * (Hi * D) ** -0.5
    k_cache = jax.random.normal(ks[2], (num_pages, page_size, D), jnp.float32).astype(dtype)
    page_table = (jax.random.permutation(ks[3], num_pages - 1)[: S * max_pages] + 1).reshape(S, max_pages)
    return q, w, k_cache, page_table.astype(jnp.int32)


@section
def check_indexer():
    T, S, ctx, k = 96, 3, 8192, 2048
    q, w, k_cache, pt = paged_problem(jax.random.key(2), T, S, ctx)
    seq = jnp.array([0] * 64 + [1] * 31 + [2], jnp.int32)  # prefill chunk of seq 0, of seq 1, one decode of seq 2
    lens = jnp.concatenate([jnp.arange(4000, 4064), jnp.arange(1, 32), jnp.array([8192])]).astype(jnp.int32)
    kw = dict(kv_lens=lens, page_table=pt, seq_ids=seq)
    ref_logits = index_logits_reference(q, w, k_cache, **kw)
    got_logits = jax.jit(lambda *a: index_logits_pallas(*a, **kw))(q, w, k_cache)[:T]
    e = rel_err(jnp.where(jnp.isfinite(ref_logits), got_logits, 0), jnp.where(jnp.isfinite(ref_logits), ref_logits, 0))
    tol = 1e-4 * float(jnp.max(jnp.where(jnp.isfinite(ref_logits), jnp.abs(ref_logits), 0)))
    bad = 0
    for opts in [dict(), OLD_INDEXER]:
        got = jax.jit(lambda *a: indexer_topk_pallas(*a, topk=k, **kw, **opts))(q, w, k_cache)
        bad_opts = topk_errors(got, ref_logits, lens, k, tol)
        say(f"check indexer bf16 paged {label(opts)}: logits rel err {e:.2e}, invalid top-k rows {bad_opts}/{T}")
        bad += bad_opts
    k8, sc = quantize_index_k_fp8(k_cache)
    ref8 = index_logits_reference(q, w, k8, k_scale=sc, **kw)
    got8 = jax.jit(lambda *a: indexer_topk_pallas(*a, k_scale=sc, topk=k, **kw))(q, w, k8)
    tol8 = 1e-4 * float(jnp.max(jnp.where(jnp.isfinite(ref8), jnp.abs(ref8), 0)))
    bad8 = topk_errors(got8, ref8, lens, k, tol8)
    valid = jnp.isfinite(ref_logits)
    e8 = float(jnp.max(jnp.abs(jnp.where(valid, ref8 - ref_logits, 0)))) / float(jnp.max(jnp.where(valid, jnp.abs(ref_logits), 0)))
    say(f"check indexer fp8 paged: invalid top-k rows {bad8}/{T}; fp8 vs bf16 max score err {e8:.3f} of max |score|")
    assert bad == 0 and bad8 == 0 and e < 1e-4


@section
def check_sparse_mla():
    T, H, rows, k = 16, 128, 65536, 2048
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (T, H, 576)).astype(jnp.bfloat16)
    cache = jax.random.normal(ks[1], (rows // 64, 64, 576)).astype(jnp.bfloat16)
    idx = jax.random.randint(ks[2], (T, k), 0, rows).astype(jnp.int32)
    idx = idx.at[1, 100:].set(-1).at[2].set(-1).at[3, ::2].set(-1)
    for opts in [dict(), OLD_MLA, dict(num_splits=8), dict(num_splits=2, block_h=64, num_warps=8)]:
        got = jax.jit(lambda *a: sparse_mla_attention_pallas(*a, scale=576 ** -0.5, **opts))(q, cache, idx)
        ref = sparse_mla_attention_reference(q.astype(jnp.float32), cache.astype(jnp.float32), idx, scale=576 ** -0.5)
        e = rel_err(got.astype(jnp.float32), ref)
        say(f"check sparse_mla {opts}: rel err {e:.2e}, empty row zero {bool(jnp.all(got[2] == 0))}")
        assert e < 2e-2 and bool(jnp.all(got[2] == 0))
    if MOSAIC_MLA:
        flat = cache.reshape(-1, 576)
        for splits in [None, 1]:
            got = jax.jit(lambda *a: sparse_mla_decode_mosaic(*a, scale=576 ** -0.5, num_splits=splits))(q, flat, idx)
            e = rel_err(got.astype(jnp.float32), ref)
            say(f"check sparse_mla mosaic splits={splits}: rel err {e:.2e}, empty row zero "
                f"{bool(jnp.all(got[2] == 0))}")
            assert e < 2e-2 and bool(jnp.all(got[2] == 0))


@section
def check_gmm():
    M, K, N, E = 4096, 1024, 960, 32
    ks = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(ks[0], (M, K)).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    sizes = jax.random.randint(ks[2], (E,), 0, 200).at[3].set(0).at[4].set(0).astype(jnp.int32)
    total = int(sizes.sum())
    got = jax.jit(grouped_matmul_pallas)(x, w, sizes)
    ref = lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes, precision=lax.Precision.HIGHEST)
    e = rel_err(got.astype(jnp.float32), ref)
    tail_zero = bool(jnp.all(got[total:] == 0))
    say(f"check grouped_matmul: rel err {e:.2e} (total {total} of {M} rows), tail zero {tail_zero}")
    assert e < 1e-2 and tail_zero


# ------------------------------------------------------------------------------------------------- timings

SELECT_VARIANTS = [OLD_SELECT, dict(), dict(early_stop=False), dict(compaction="row"), dict(digit_bits=2),
                   dict(digit_bits=4), dict(num_warps=16), dict(chunk=8192), dict(chunk=8192, num_warps=16),
                   dict(num_stages=2), dict(compact_lanes=16384), dict(compact_lanes=1024)]


@section
def bench_select(quick):
    """Exact top-2048 of 4096 rows x 65536 float32 (the issue-14 target: >= 10x lax.top_k, faster than torch.topk).
    `{}` = the defaults (SELECT_TILES); the `gmax given` row is the select as the indexer runs it, the group maxima
    coming from the logits kernel."""
    T, N, k = 4096, 65536, 2048
    x = jax.random.normal(jax.random.key(5), (T, N))
    lens = jnp.full((T,), N, jnp.int32)
    t_ref = timeit(jax.jit(lambda x: lax.top_k(x, k)[1]), x)
    t_torch = torch_topk_seconds(x, k)
    if t_torch is not None:
        say(f"  torch.topk {T}x{N} k={k}: {t_torch * 1e3:.3f} ms; lax.top_k {t_ref * 1e3:.3f} ms")
    floor = T * N * 4 / COPY_BANDWIDTH
    vs_torch = (lambda t: f"ref = lax.top_k; torch x{t_torch / t:.2f}") if t_torch else (lambda t: "ref = lax.top_k")
    for opts in ([OLD_SELECT, dict()] if quick else SELECT_VARIANTS):
        f = jax.jit(lambda x, l: select_topk_pallas(x, l, k, **opts))
        t_k = timeit(f, x, lens)
        row(f"select top-2048 4096x65536 {'OLD ' if opts is OLD_SELECT else ''}{label(opts)}", t_k, t_ref, floor,
            vs_torch(t_k))
    gmax = jax.jit(group_maxima)(x, lens)
    for opts in [dict()] if quick else [dict(), dict(num_warps=16), dict(digit_bits=4)]:
        f = jax.jit(lambda x, g, l: select_topk_pallas(x, l, k, gmax=g, **opts))
        row(f"select top-2048 4096x65536 gmax given {label(opts)}", timeit(f, x, gmax, lens), t_ref, floor,
            "ref = lax.top_k; reads N/4 maxima + 8k candidates per row")


def xla_indexer(q, w, k_seq, kv_lens, topk, chunk=64):
    """XLA comparator that fits memory at 128k: queries in chunks, bf16 dots, float32 logits, lax.top_k."""
    T = q.shape[0]

    def one(args):
        qc, wc, kc, lc = args  # kc: [chunk, N, D] or shared [N, D]
        eq = "thd,nd->thn" if kc.ndim == 2 else "thd,tnd->thn"
        s = jnp.einsum(eq, qc, kc, preferred_element_type=jnp.float32)
        lg = jnp.einsum("thn,th->tn", jax.nn.relu(s), wc)
        lg = jnp.where(jnp.arange(lg.shape[1]) < lc[:, None], lg, -jnp.inf)
        return lax.top_k(lg, topk)[1]

    if k_seq.ndim == 2:
        c = min(chunk, T)
        r = lax.map(lambda a: one((a[0], a[1], k_seq, a[2])),
                    (q.reshape(T // c, c, *q.shape[1:]), w.reshape(T // c, c, -1), kv_lens.reshape(T // c, c)))
        return r.reshape(T, topk)
    return one((q, w, k_seq, kv_lens))


def indexer_variants(kind, T, ctx, quick):
    """Kernel options timed per case: the defaults and the pre-issue-14 kernels everywhere; at decode the select's
    knobs too (B=1 over a long context is one select program per row: its latency is the case)."""
    if quick or kind == "prefill":
        return [dict(), OLD_INDEXER]
    extra = [dict(digit_bits=4), dict(digit_bits=2), dict(fuse_group_max=False)] + [
        # More keys per program with the queries' q loaded once (at decode each 128-key program re-read its q).
        dict(logits_options=o) for o in (dict(tiles_per_program=4), dict(tiles_per_program=8),
                                         dict(tiles_per_program=8, num_warps=8), dict(block_kv=256, num_warps=8))]
    if ctx >= 131072:  # the long-row tiles (16 warps, maxima in registers) against 8 warps reading them from L2
        extra += [dict(num_warps=8, gmax_in_registers=16384), dict(num_warps=16, digit_bits=4)]
    return [dict(), OLD_INDEXER] + extra


def timed(op, shared, per_call):
    """Seconds per op(*shared, *per_call[i]), all of them in one executable (`kernel_report.in_one_graph`)."""
    return timeit(in_one_graph(op), shared, per_call) / len(per_call)


def sets_for(floor_s: float, nbytes: int) -> int:
    """Operand sets a row runs in one executable: one unless the op is short enough for the host's dispatch of a
    call to hide it (DISPATCH_BOUND_S), then enough to overflow L2, at most 16 (each one compiles a kernel call)."""
    return copies_for(nbytes, cap=16) if floor_s < DISPATCH_BOUND_S else 1


@section
def bench_indexer(quick):
    """Decode rows with too little work for a call on its own (one query) run over several sequences' pages in one
    executable (`sets_for`), each call its own sequences."""
    k, Hi, D = 2048, 64, 128
    cases = [(kind, T) for kind, T in [("decode", 1), ("decode", 16), ("decode", 32), ("prefill", 2048)]
             if kind in INDEXER_KINDS]
    for ctx in CTXS:
        for kind, T in cases:
            S = T if kind == "decode" else 1
            if kind == "decode":
                seq = jnp.arange(T, dtype=jnp.int32)
                lens = jnp.full((T,), ctx, jnp.int32)
                keys_read = T * ctx
                flops = 2 * T * Hi * D * ctx
            else:
                seq = jnp.zeros((T,), jnp.int32)
                lens = (ctx - T + 1 + jnp.arange(T)).astype(jnp.int32)  # the last 2k-token chunk of the context
                keys_read = ctx
                flops = 2 * Hi * D * int(lens.sum())
            bytes_ = keys_read * D * 2 + T * Hi * D * 2 + T * k * 4
            floor = max(bytes_ / COPY_BANDWIDTH, flops / BF16_PEAK)
            sets = sets_for(floor, bytes_)
            q, w, k_cache, pt_all = paged_problem(jax.random.key(ctx + T), T, S * sets, ctx)
            tables = [(pt_all[i * S:(i + 1) * S],) for i in range(sets)]
            kw = dict(kv_lens=lens, seq_ids=seq)
            k_seqs = [(k_cache[pt].reshape(S, ctx, D)[0] if kind == "prefill" else k_cache[pt].reshape(S, ctx, D),)
                      for pt, in tables]
            say(f"  indexer {kind} T={T} ctx={ctx}: {sets} call(s) per executable")
            t_r = timed(lambda q, w, ks: xla_indexer(q, w, ks, lens, k), (q, w), k_seqs)
            del k_seqs
            for opts in indexer_variants(kind, T, ctx, quick):
                f = functools.partial(indexer_topk_pallas, topk=k, **kw, **opts)
                old = "OLD " if opts is OLD_INDEXER else ""
                row(f"indexer bf16 {kind} T={T} ctx={ctx} {old}{label(opts)}",
                    timed(lambda q, w, kc, pt: f(q, w, kc, page_table=pt), (q, w, k_cache), tables), t_r, floor,
                    "ref = XLA logits + lax.top_k")
            if kind == "decode" and T > 1:  # the engine's index-key cache is FP8
                k8, sc = quantize_index_k_fp8(k_cache)
                floor8 = max((keys_read * (D + 4) + T * Hi * D * 2 + T * k * 4) / COPY_BANDWIDTH, flops / BF16_PEAK)
                for opts in [dict()] + ([] if quick else [dict(logits_options=dict(tiles_per_program=8))]):
                    f8 = functools.partial(indexer_topk_pallas, topk=k, **kw, **opts)
                    row(f"indexer fp8  {kind} T={T} ctx={ctx} {label(opts)}",
                        timed(lambda q, w, kc, s, pt: f8(q, w, kc, k_scale=s, page_table=pt), (q, w, k8, sc), tables),
                        t_r, floor8, "ref = XLA bf16")


def mla_variants(B, listed, quick):
    """`{}` = the defaults (default_tiles: at decode DECODE_TARGET_PROGRAMS decides the splits)."""
    if quick:
        return [OLD_MLA, dict()]
    if listed < 2048:  # what trimming the −1 tail saves
        return [OLD_MLA, dict(), dict(num_splits=1)]
    splits = [n for n in (1, 2, 4, 8, 16) if B * n <= 512]
    # 64-head blocks on 8 warps (wgmma, ~800 bytes of spills), 8 warps on 32 heads and 16-row gathers were slower
    # than these everywhere on the H200 (2026-12-01 03:40 UTC, B=128: 0.53-1.09 ms against 0.33); multi-stage
    # 64-row gathers were the best there. Value blocks (64 heads a program on half the value columns, every block
    # recomputing the scores; reverted) lost too (2026-12-02 08:16 UTC, B=128: 0.39-0.86 ms against 0.31), and 128
    # heads on a quarter of the columns asked for 288 KB of shared memory (the H200 has 227). Value columns gathered
    # a second time for P @ V (a load per dot; reverted) lost too (2026-12-02 16:38 UTC, B=128: 32 heads 0.462 ms,
    # 64 heads on 8 warps 0.493-0.754, against 0.309; 64 heads without them 0.359).
    # The transposed products (scores [keys, heads], accumulator [512, heads]: keys as the dots' M, so that wgmma
    # could take 32-head tiles with the query block read from shared memory once per warpgroup; reverted) lost too
    # (2026-12-03 05:55 UTC, B=128: 0.415-0.503 ms over 32 / 64 heads, 32-128-row gathers, against 0.310).
    return [OLD_MLA, dict()] + [dict(num_splits=n) for n in splits] + [
        dict(num_stages=2), dict(block_k=32, num_stages=3), dict(block_k=64, num_stages=2)] + [
        dict(block_k=64, num_stages=3, num_splits=n) for n in splits]


@section
def bench_sparse_mla(quick):
    """Decode (one query per sequence, a full top-2048 list each, random rows of a 256k-row cache). Floor = the
    bytes (rows gathered once, q, out, indices) at 4.25 TB/s, the issue's measure; the note gives the FLOP floor,
    which is larger from B=128 on (2·H·k·(576+512) FLOPs per query at 810 TFLOP/s)."""
    H, k, rows = 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows // 64, 64, 576)).astype(jnp.bfloat16)
    # The last case: contexts shorter than k, lists half −1.
    cases = [(B, k) for B in MLA_BATCHES] + [(32, 1024)] * (32 in MLA_BATCHES)
    for B, listed in cases:
        bytes_ = B * listed * 576 * 2 + B * H * 576 * 2 + B * H * 512 * 2 + B * k * 4
        floor = bytes_ / COPY_BANDWIDTH
        flop_floor = 2 * B * H * listed * (576 + 512) / BF16_PEAK
        sets = sets_for(max(floor, flop_floor), bytes_)  # one query: several queries' lists in one executable

        def problem(i):
            q = jax.random.normal(jax.random.key(B + 2 * i), (B, H, 576)).astype(jnp.bfloat16)
            idx = jax.random.randint(jax.random.key(B + 2 * i + 1), (B, k), 0, rows).astype(jnp.int32)
            return q, jnp.where(jnp.arange(k) < listed, idx, -1)

        problems = [problem(i) for i in range(sets)]
        say(f"  sparse MLA decode B={B} keys={listed}: {sets} call(s) per executable")
        t_r = timed(lambda c, q, i: sparse_mla_attention_reference(q, c, i, scale=0.04), (cache,), problems)
        for opts in mla_variants(B, listed, quick):
            old = "OLD " if opts is OLD_MLA else ""
            try:
                t_k = timed(lambda c, q, i: sparse_mla_attention_pallas(q, c, i, scale=0.04, **opts), (cache,),
                            problems)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is reported
                say(f"sparse MLA decode B={B} {label(opts)}: does not run: {type(e).__name__}: {str(e)[:200]}")
                continue
            row(f"sparse MLA decode B={B} keys={listed} {old}{label(opts)}", t_k, t_r, floor,
                f"FLOP floor {flop_floor * 1e3:.3f} ms = {100 * flop_floor / t_k:.0f}%")
        if not MOSAIC_MLA:
            continue
        n = jnp.full((B,), listed, jnp.int32)
        try:  # the Hopper kernel (sparse_mla_mosaic), on the indexer's counts as the model passes them
            t_m = timed(lambda c, q, i: sparse_mla_decode_mosaic(q, c.reshape(-1, 576), i, scale=0.04, listed=n),
                        (cache,), problems)
        except Exception as e:  # noqa: BLE001 - reported, as a tile that does not compile is
            say(f"sparse MLA decode B={B} mosaic: does not run: {type(e).__name__}: {str(e)[:300]}")
            continue
        row(f"sparse MLA decode B={B} keys={listed} MOSAIC", t_m, t_r, floor,
            f"FLOP floor {flop_floor * 1e3:.3f} ms = {100 * flop_floor / t_m:.0f}%")


@section
def bench_sparse_mla_prefill(quick):
    """A 2048-token chunk, every token with a full top-k list; FLOP-bound (all 128 heads share the rows)."""
    H, k, rows = 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows // 64, 64, 576)).astype(jnp.bfloat16)
    T = 2048
    q = jax.random.normal(jax.random.key(T), (T, H, 576)).astype(jnp.bfloat16)
    idx = jax.random.randint(jax.random.key(T + 1), (T, k), 0, rows).astype(jnp.int32)
    floor = 2 * T * H * k * (576 + 512) / BF16_PEAK
    variants = [dict()] if quick else [  # dict() = the defaults for a prefill chunk (PREFILL_TILES)
        dict(), dict(block_k=32, num_stages=1), dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
        dict(block_k=128, num_stages=2), dict(block_h=64, block_k=64, num_stages=3)]
    for opts in variants:
        f = jax.jit(lambda q, c, i: sparse_mla_attention_pallas(q, c, i, scale=0.04, **opts))
        row(f"sparse MLA prefill T={T} {opts}", timeit(f, q, cache, idx), None, floor, "floor = FLOPs at 810 TFLOP/s")
    if not MOSAIC_MLA:
        return
    # auto's kernel on Hopper, which the model's prefill chunks take too. decode_splits cuts a 2,048-query chunk's
    # lists in 8 (4 blocks a program; on 132 SMs an SM walks 996 blocks, against 1,024 unsplit), though each split
    # loads the queries again and writes float32 partials for a combine: one and two splits beside it tell what that
    # costs.
    chosen = decode_splits(T, H, k)
    for splits in dict.fromkeys([chosen, 1, 2]):
        f = jax.jit(lambda q, c, i, n=splits: sparse_mla_decode_mosaic(q, c.reshape(-1, 576), i, scale=0.04,
                                                                      num_splits=n))
        auto = " (auto)" if splits == chosen else ""
        row(f"sparse MLA prefill T={T} MOSAIC splits={splits}{auto} {schedule_for(k, splits)}",
            timeit(f, q, cache, idx), None, floor, "floor = FLOPs at 810 TFLOP/s")


def routed_sizes(key, tokens, E, topk):
    """Group sizes of random top-k routing (each token picks topk distinct experts)."""
    choice = jax.vmap(lambda kk: jax.random.choice(kk, E, (topk,), replace=False))(jax.random.split(key, tokens))
    return jnp.bincount(choice.reshape(-1), length=E).astype(jnp.int32)


GMM_SHAPES = [("DeepSeek 256x8 K7168 N2048", 256, 8, 7168, 2048), ("Nemotron-30B 128x6 K2688 N1856", 128, 6, 2688, 1856)]
# The down projections, whose K (Nemotron's 1856) is not a power of two, timed at decode only.
GMM_DOWN_SHAPES = [("DeepSeek 256x8 K2048 N7168", 256, 8, 2048, 7168),
                   ("Nemotron-30B 128x6 K1856 N2688", 128, 6, 1856, 2688)]
# Decode tiles: few rows per expert leave few programs with the default 256 columns (Nemotron-30B at one token:
# 6 experts x 8 column tiles = 48 programs doing work on 132 SMs), so narrower column tiles are in the sweep.
# `{}` = the defaults; trim_items (grouped_matmul.make_schedule) drops the grid's programs that find no expert.
# 2026-12-02 (docs/BENCHMARKS.md, eleventh run): 2-warp 64-column tiles and 256 columns on 8 warps never won and
# were dropped, so that the sweep ends within its 280 s; 32-row tiles won at 256 sequences only.
GMM_DECODE_VARIANTS = [dict(), dict(trim_items=True), dict(block_n=64, num_warps=4),
                       dict(block_n=64, num_warps=4, trim_items=True), dict(block_m=32)]


@section
def bench_gmm(quick, decode_only=False):
    if decode_only:
        for shape in GMM_SHAPES + GMM_DOWN_SHAPES:
            bench_gmm_decode(quick, *shape)
        return
    for name, E, topk, K, N in GMM_SHAPES:
        w = (jax.random.normal(jax.random.key(7), (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
        for tokens in [2048, 16384]:
            M = tokens * topk
            x = jax.random.normal(jax.random.key(tokens), (M, K)).astype(jnp.bfloat16)
            sizes = routed_sizes(jax.random.key(tokens + 1), tokens, E, topk)
            flops = 2 * M * K * N
            floor = max(flops / BF16_PEAK, (E * K * N + M * K + M * N) * 2 / COPY_BANDWIDTH)  # weights read once
            # XLA's ragged_dot materialises an [E, M, K] operand: 448 GiB at 16k tokens (out of memory on the
            # H200), so it is timed at 2k tokens only.
            t_r = timeit(jax.jit(grouped_matmul_reference), x, w, sizes, target_s=0.05) if tokens <= 2048 \
                else float("nan")
            t_d = timeit(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)),
                         x, w[0])
            say(f"  dense [{M}x{K}]@[{K}x{N}] bf16: {t_d * 1e3:.3f} ms = {flops / t_d / 1e12:.0f} TFLOP/s; "
                f"ragged_dot {flops / t_r / 1e12:.1f} TFLOP/s")
            variants = [dict()] if quick else [dict(), dict(block_n=256, num_warps=8, num_stages=3),
                                               dict(num_warps=8, num_stages=3)]
            for opts in variants:
                f = jax.jit(lambda a, b, c: grouped_matmul_pallas(a, b, c, **opts))
                t_k = timeit(f, x, w, sizes)
                row(f"gmm {name} tok={tokens} {opts}", t_k, t_r, floor,
                    f"{flops / t_k / 1e12:.0f} TFLOP/s = {100 * t_d / t_k:.0f}% of dense")
        bench_gmm_decode(quick, name, E, topk, K, N, w)


def bench_gmm_decode(quick, name, E, topk, K, N, w=None):
    """A few rows per expert, bound by reading the touched experts' weights once. A one-token call is shorter than
    the host's dispatch of a jitted call, so every row runs several routings (each its own experts) in one
    executable (`timed`) and reports the time per call, as a decode step runs them, with the weights mostly cold in
    L2; the floor is the mean touched experts' weight bytes. (Timed call by call before 2026-12-02.)"""
    if w is None:
        w = (jax.random.normal(jax.random.key(7), (E, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    for tokens in [1, 32, 256]:
        M = tokens * topk
        x = jax.random.normal(jax.random.key(tokens), (M, K)).astype(jnp.bfloat16)
        # (at 256 tokens a call outlasts the dispatch, and ragged_dot's [E, M, K] operand is GBs: two routings)
        routings = [(routed_sizes(jax.random.key(tokens + 1 + i), tokens, E, topk),)
                    for i in range(16 if tokens <= 32 else 2)]
        touched = float(np.mean([int(jnp.sum(sizes > 0)) for sizes, in routings]))
        floor = (touched * K * N + M * K + M * N) * 2 / COPY_BANDWIDTH
        t_r = timed(grouped_matmul_reference, (x, w), routings)
        for opts in [dict()] if quick else GMM_DECODE_VARIANTS:
            t = timed(functools.partial(grouped_matmul_pallas, **opts), (x, w), routings)
            row(f"gmm {name} decode B={tokens} {opts}", t, t_r, floor,
                f"{touched:.1f} experts touched, {len(routings)} routings in one graph")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one variant and one context per section")
    ap.add_argument("--only", default="", help="comma list of sections: select,indexer,mla (decode and prefill),"
                    "mla_decode,mla_prefill,gmm,gmm_decode (decode rows only, up and down projections)")
    ap.add_argument("--log", default=None)
    ap.add_argument("--ctx", default="8192,32768,131072", help="indexer contexts")
    ap.add_argument("--indexer-kinds", default="decode,prefill", help="indexer cases: decode (B=1, 32), prefill")
    ap.add_argument("--mla-batches", default="1,32,128", help="sparse MLA decode batch sizes")
    ap.add_argument("--no-mosaic", action="store_true", help="sparse MLA: leave out the Mosaic GPU kernel")
    args = ap.parse_args()
    global MOSAIC_MLA
    MOSAIC_MLA = not args.no_mosaic and mosaic_kernels_available()
    MLA_BATCHES[:] = [int(b) for b in args.mla_batches.split(",")]
    CTXS[:] = [int(c) for c in args.ctx.split(",")]
    INDEXER_KINDS[:] = args.indexer_kinds.split(",")
    open_log(args.log)
    say(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    only = set(filter(None, args.only.split(",")))
    want = lambda s: not only or s in only  # noqa: E731
    if args.check:
        for names, fn in [(["select"], check_select), (["indexer"], check_indexer),
                          (["mla", "mla_decode"], check_sparse_mla), (["gmm", "gmm_decode"], check_gmm)]:
            if any(map(want, names)):
                fn()
    if want("select"):
        bench_select(args.quick)
    if want("gmm"):
        bench_gmm(args.quick)
    if "gmm_decode" in only:  # (a full run's gmm section times the up projections' decode rows already)
        bench_gmm(args.quick, decode_only=True)
    if want("mla") or want("mla_decode"):
        bench_sparse_mla(args.quick)
    if want("mla") or want("mla_prefill"):
        bench_sparse_mla_prefill(args.quick)
    if want("indexer"):
        bench_indexer(args.quick)
    say("\n=== summary")
    for r in ROWS:
        say(r)


if __name__ == "__main__":
    sys.exit(main())
