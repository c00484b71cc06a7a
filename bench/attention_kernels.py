"""Paged GQA attention on the GPU: the Pallas kernel vs its XLA reference, side by side, with the bandwidth floor.

    PYTHONPATH=. python bench/attention_kernels.py [--check] [--shape nano9b|nano30b] [--log FILE]
        [--block-q 2,4] [--block-k 64,128] [--num-warps 4,8] [--num-stages 2,3] [--num-splits 1,8]
    PYTHONPATH=. python bench/attention_kernels.py --interpret --check     # CPU smoke run on tiny shapes

Cases (bf16, page size 16): decode of B in {1, 32, 256} sequences at context 1k and 8k (one token each, at the last
position), and one 2048-token prefill chunk at positions 2048..4095 (context 4k). The page tables are exactly as wide
as the context, which flatters the reference: it gathers the whole page-table row for every token, while the engine's
tables are max_seq_len wide.
Floor: the K/V bytes the step needs (every sequence's keys and values up to its last position, read once) at 4.25
TB/s, the H200's device-to-device copy rate (../shared/DESIGN.md).
Tile flags take comma lists; every combination is timed (a flag left out keeps the kernel's default, see
`paged_attention_pallas`). Times: jitted call issued n times back to back then one block_until_ready, divided by n;
median of 5 rounds. The last line is the headline.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.benchmark_floors import COPY_BANDWIDTH  # the H200's device-to-device copy rate
from kernel_report import ROWS, open_log, say, section, timeit
from pallas_kernels.paged_attention import (DEFAULT_BLOCK_K, default_block_q, default_num_splits,
                                            paged_attention_pallas, paged_attention_reference)

PAGE_SIZE = 16
SHAPES = {"nano9b": dict(heads=40, kv_heads=8, head_dim=128), "nano30b": dict(heads=32, kv_heads=2, head_dim=128)}
# CPU smoke shapes: R = 5 (padded to 8) as in Nano-9B, tiny contexts.
TINY = dict(heads=10, kv_heads=2, head_dim=16)
BEST: dict[str, tuple[float, float, float]] = {}  # case -> (fastest kernel s, reference s, floor s)
HEADLINE_CASE = "decode B=32 ctx=8192"
INTERPRET = False








# ------------------------------------------------------------------------------------------------- problems

def make_case(key, chunks, *, heads, kv_heads, head_dim, pad_tokens=0, pad_seqs=0, dtype=jnp.bfloat16):
    """Sequences with chunks (start, length), each on its own random pages (page 0 left to padding), the cache
    random everywhere it is read and NaN in page 0; `pad_tokens` padding tokens and `pad_seqs` empty sequences at the
    end. Returns (q, k_pages, v_pages, kwargs of paged_attention, number of real tokens, K/V rows needed)."""
    ctx = max(start + n for start, n in chunks)
    max_pages = -(-ctx // PAGE_SIZE)
    S = len(chunks)
    num_pages = S * max_pages + 1
    ks = jax.random.split(key, 4)
    shape = (num_pages, PAGE_SIZE, kv_heads, head_dim)
    k_pages = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype).at[0].set(jnp.nan)
    v_pages = jax.random.normal(ks[1], shape, jnp.float32).astype(dtype).at[0].set(jnp.nan)
    page_table = (jax.random.permutation(ks[2], num_pages - 1) + 1).reshape(S, max_pages)
    page_table = jnp.concatenate([page_table, jnp.zeros((pad_seqs, max_pages), page_table.dtype)]).astype(jnp.int32)
    lengths = [n for _, n in chunks] + [0] * pad_seqs
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    positions = np.concatenate([np.arange(start, start + n) for start, n in chunks] + [np.zeros(pad_tokens, int)])
    T = len(positions)
    q = jax.random.normal(ks[3], (T, heads, head_dim), jnp.float32).astype(dtype)
    kw = dict(page_table=page_table, cu_seqlens=cu, positions=jnp.asarray(positions, jnp.int32),
              scale=head_dim ** -0.5)
    return q, k_pages, v_pages, kw, T - pad_tokens, sum(start + n for start, n in chunks)


def cases(shape_name):
    """(name, chunks) of the benchmark table."""
    if INTERPRET:
        return [("tiny decode B=1 ctx=64", [(63, 1)]), ("tiny decode B=4 ctx=128", [(127, 1)] * 4),
                ("tiny prefill chunk 32 ctx=64", [(32, 32)])]
    out = []
    for ctx in (1024, 8192):
        for B in (1, 32, 256):
            out.append((f"{shape_name} decode B={B} ctx={ctx}", [(ctx - 1, 1)] * B))
    out.append((f"{shape_name} prefill chunk 2048 ctx=4096", [(2048, 2048)]))
    return out


def shape_of(name):
    return TINY if INTERPRET else SHAPES[name]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def jitted(attention, q, k, v, kw, **options):
    """(jitted f, its arguments): the scale is baked in, the arrays are arguments."""
    scale = kw["scale"]
    arrays = {n: kw[n] for n in ("page_table", "cu_seqlens", "positions")}
    f = jax.jit(lambda q, k, v, a: attention(q, k, v, scale=scale, **a, **options))
    return f, (q, k, v, arrays)


def kernel(q, k, v, kw, **options):
    return jitted(paged_attention_pallas, q, k, v, kw, interpret=INTERPRET, **options)


def reference(q, k, v, kw):
    return jitted(paged_attention_reference, q, k, v, kw)


# ------------------------------------------------------------------------------------------------- check

@section
def check(shape_name, variants):
    """Compiled kernel vs reference: bf16 decode and prefill with padding (NaN in the null page), float32 exact."""
    sh = shape_of(shape_name)
    small = INTERPRET
    problems = [
        ("bf16 decode B=32 ctx=1k, 3 padding slots", [(1023 - 7 * i, 1) for i in range(29)], 3, 3, jnp.bfloat16),
        ("bf16 prefill 2048 at 2048 + decodes, padding", [(2048, 2048), (4095, 1), (100, 1)], 5, 1, jnp.bfloat16),
        ("float32 mixed (IEEE dots: TF32 would show 1e-3)", [(700, 77), (1500, 1), (0, 9)], 2, 1, jnp.float32),
    ]
    if small:
        problems = [("bf16 decode B=6, 2 padding slots", [(40 - 7 * i, 1) for i in range(4)], 2, 2, jnp.bfloat16),
                    ("bf16 prefill 20 at 30 + decode", [(30, 20), (63, 1)], 3, 1, jnp.bfloat16),
                    ("float32 mixed", [(40, 7), (17, 1), (0, 9)], 2, 1, jnp.float32)]
    for name, chunks, pad_tokens, pad_seqs, dtype in problems:
        q, k, v, kw, real, _ = make_case(jax.random.key(len(chunks)), chunks, **sh, pad_tokens=pad_tokens,
                                         pad_seqs=pad_seqs, dtype=dtype)
        f_ref, args = reference(q, k, v, kw)
        want = np.asarray(f_ref(*args), np.float32)
        for options in variants:
            f, args = kernel(q, k, v, kw, **options)
            got = np.asarray(f(*args), np.float32)
            err = rel_err(got[:real], want[:real])
            zeros = bool(np.all(got[real:] == 0))
            finite = bool(np.all(np.isfinite(got)))
            bound = 1e-5 if dtype == jnp.float32 else 1e-2
            ok = err < bound and zeros and finite
            say(f"check {name} {options or 'defaults'}: rel err {err:.2e} (< {bound:g}), padding zero {zeros}, "
                f"finite {finite} -> {'ok' if ok else 'FAIL'}")
            assert ok, name


# ------------------------------------------------------------------------------------------------- timings

def resolved_tiles(T, S, sh, max_keys, options):
    bq = options.get("block_q") or default_block_q(T, S, sh["heads"], sh["kv_heads"])
    bk = options.get("block_k", DEFAULT_BLOCK_K)
    ns = options.get("num_splits") or default_num_splits(T, S, sh["kv_heads"], max_keys, bq, bk)
    return f"bq={bq} bk={bk} splits={ns}"


@section
def bench(shape_name, variants):
    sh = shape_of(shape_name)
    say(f"{'case':<40} {'tiles':<36} {'kernel':>11} {'reference':>11} {'speedup':>8} {'floor':>10} {'% floor':>8}")
    for name, chunks in cases(shape_name):
        q, k, v, kw, real, kv_rows = make_case(jax.random.key(len(chunks)), chunks, **sh)
        floor = 2 * kv_rows * sh["kv_heads"] * sh["head_dim"] * k.dtype.itemsize / COPY_BANDWIDTH
        try:
            f_ref, args = reference(q, k, v, kw)
            t_ref = timeit(f_ref, *args)
        except Exception as e:  # noqa: BLE001  (the reference can run out of memory where the kernel does not)
            say(f"{name}: reference FAILED {type(e).__name__}: {str(e)[:200]}")
            t_ref = float("nan")
        T, S = q.shape[0], kw["page_table"].shape[0]
        max_keys = kw["page_table"].shape[1] * PAGE_SIZE
        for options in variants:
            f, args = kernel(q, k, v, kw, **options)
            t = timeit(f, *args)
            tiles = resolved_tiles(T, S, sh, max_keys, options) + "".join(
                f" {n}={options[n]}" for n in ("num_warps", "num_stages") if n in options)
            line = (f"{name:<40} {tiles:<36} {t * 1e6:8.1f} us {t_ref * 1e6:8.1f} us {t_ref / t:7.1f}x "
                    f"{floor * 1e6:7.1f} us {100 * floor / t:7.1f}%")
            ROWS.append(line)
            say(line)
            if name not in BEST or t < BEST[name][0]:
                BEST[name] = (t, t_ref, floor)


def tile_variants(args):
    """Every combination of the tile flags given (a flag left out keeps the kernel default)."""
    axes = []
    for name in ("block_q", "block_k", "num_warps", "num_stages", "num_splits"):
        values = getattr(args, name)
        axes.append([(name, int(x)) for x in values.split(",")] if values else [None])
    return [dict(p for p in combo if p) for combo in itertools.product(*axes)]


def main():
    global INTERPRET
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="correctness of the compiled kernel first")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: interpret mode, tiny shapes")
    ap.add_argument("--shape", default="nano9b", choices=sorted(SHAPES))
    for flag in ("block-q", "block-k", "num-warps", "num-stages", "num-splits"):
        ap.add_argument(f"--{flag}", default="", help="comma list of values to time")
    ap.add_argument("--log", default=None)
    args = ap.parse_args()
    INTERPRET = args.interpret
    open_log(args.log)
    say(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, shape {args.shape if not INTERPRET else 'tiny'}")
    variants = tile_variants(args)
    if args.check:
        check(args.shape, variants)
    bench(args.shape, variants)
    say("\n=== summary")
    for r in ROWS:
        say(r)
    headline = next((n for n in BEST if HEADLINE_CASE in n), next(iter(BEST), None))
    if headline:
        t, t_ref, floor = BEST[headline]
        say(f"headline: {headline}: kernel {t * 1e6:.1f} us = {100 * floor / t:.0f}% of the bandwidth floor, "
            f"{t_ref / t:.1f}x the XLA reference")


if __name__ == "__main__":
    sys.exit(main())
