"""DSA lightning-indexer logits fused with an exact top-k selection, as Pallas (Triton) kernels + an XLA reference.

Score of query t against key j: `Σ_h weights[t, h] · relu(q[t, h] · k[j])` (float32). The caller folds every
scale into `weights` (DeepSeek-V3.2: `weights = w_proj(x) · Hi^-0.5 · D^-0.5`, and the FP8 query scale if any);
this module only multiplies by the FP8 per-token key scale, after the head sum, which is exact because
`relu(c·x) = c·relu(x)` for `c > 0`.

Index-K cache layouts (`k_cache`):
  * paged: `k_cache[num_pages, page_size, D]` with `page_table[S, max_pages]` int32 (page ids of sequence s in
    order; logical position `j` of sequence s lives at `k_cache[page_table[s, j // page_size], j % page_size]`)
    and `seq_ids[T]` int32 (sequence of each query). `page_size` must be a power of two for the Pallas kernel.
  * contiguous: `page_table=None`, `k_cache[S, L, D]` (one row of L keys per sequence); same as paged with
    `page_size = L` and `page_table = arange(S)[:, None]`. `seq_ids=None` means every query is sequence 0.
  * dtype bf16 / float32, or FP8 (DeepSeek's layout): `k_cache` float8_e4m3fn plus `k_scale[num_pages, page_size]`
    float32 (contiguous form: `[S, L]`), one scale per token, dequantised key `k8 · scale`
    (`quantize_index_k_fp8` builds it).
Per-query metadata: `kv_lens[T]` int32 = number of keys query t sees (keys `0 .. kv_lens[t]-1`): a prefill query
at position p passes `p + 1`, a decode query passes the sequence length, a padding token passes 0 (all −1 out).

Output: int32[T, topk] logical token positions within the query's sequence (not cache rows; see
`sparse_mla_attention.logical_to_cache_rows`), in no particular order; rows with fewer than `topk` visible keys
hold all of them, then −1. Ties at the k-th value keep the lowest positions (the same rule as `lax.top_k`).

Pallas path (two kernels, Triton lowering, `interpret=True` on CPU):
  1. `_index_logits`: grid (query blocks × key blocks), so the context is split over many programs also for one
     query. Each program loads one key tile per sequence present in its query block (K tile reused by all its
     queries), does `[Hi, D] @ [D, KB]` on the tensor cores per query, relu, weights, head-sum, FP8 scale, masks
     with -inf past `kv_lens`, and skips tiles past the block's longest row. Writes float32 logits `[T, Npad]`
     and (`FUSE_GROUP_MAX`) the maxima of each group of 4 logits as order keys, `[T, Npad / 4]`.
  2. `select_topk` (`topk_select.py`): one program per row, an exact selection without sorting: a bound from the
     group maxima (in registers), the <= 4·k keys of the groups above it gathered into registers, the exact k-th
     key among them, one emission pass. It reads the logits row only for those candidates. Few long rows (decode
     batches) are selected in segments instead (`select_segments`, `select_topk_in_segments`): each segment's top-k
     on its own program, then the top-k of their candidates, so that the batch fills the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import (as_byte_pairs, dot_precision, first_problem, fp8_problem, needs_byte_pairs, next_pow2,
                        pow2_tile_problem, resolve_impl, split_byte_pairs)
from .topk_select import GROUP, masked_keys_and_group_max, select_topk_pallas  # noqa: F401 (re-exported)

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_index_k_fp8(k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k[..., D] -> (float8_e4m3fn k[..., D], float32 scale[...]): one scale per token, amax / 448."""
    kf = k.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(kf), axis=-1), 1e-12) / FP8_MAX
    k8 = (kf / scale[..., None]).astype(jnp.float8_e4m3fn)
    return k8, scale


def _normalise_layout(k_cache, k_scale, page_table, seq_ids, T):
    """Contiguous form -> paged form with one page per sequence."""
    if page_table is None:
        page_table = jnp.arange(k_cache.shape[0], dtype=jnp.int32)[:, None]
    if seq_ids is None:
        seq_ids = jnp.zeros((T,), jnp.int32)
    return k_cache, k_scale, page_table.astype(jnp.int32), seq_ids.astype(jnp.int32)


def index_logits_reference(q, weights, k_cache, *, kv_lens, page_table=None, seq_ids=None, k_scale=None):
    """float32 logits[T, max_pages * page_size]; -inf where j >= kv_lens[t]. Plain XLA, float32 throughout."""
    T, Hi, D = q.shape
    k_cache, k_scale, page_table, seq_ids = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    page_size = k_cache.shape[1]
    n_keys = page_table.shape[1] * page_size
    keys = k_cache[page_table].reshape(page_table.shape[0], n_keys, D).astype(jnp.float32)  # [S, N, D]
    keys_q = keys[seq_ids]  # [T, N, D]
    s = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), keys_q, precision=lax.Precision.HIGHEST)
    logits = jnp.einsum("thn,th->tn", jax.nn.relu(s), weights.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)
    if k_scale is not None:
        scales = k_scale[page_table].reshape(page_table.shape[0], n_keys).astype(jnp.float32)
        logits = logits * scales[seq_ids]
    valid = jnp.arange(n_keys)[None, :] < kv_lens[:, None]
    return jnp.where(valid, logits, -jnp.inf)


def topk_reference(logits, kv_lens, topk):
    """Exact top-k over valid entries with `lax.top_k` (a sort); −1 where fewer than topk are valid."""
    T, N = logits.shape
    if N < topk:
        logits = jnp.pad(logits, ((0, 0), (0, topk - N)), constant_values=-jnp.inf)
    _, idx = lax.top_k(logits, topk)
    n_valid = jnp.minimum(kv_lens, N)
    # top_k puts the valid (finite) entries first; its positions among them are ranks, so rank < n_valid is valid.
    return jnp.where(jnp.arange(topk)[None, :] < n_valid[:, None], idx, -1).astype(jnp.int32)


def indexer_topk_reference(q, weights, k_cache, *, kv_lens, topk, page_table=None, seq_ids=None, k_scale=None):
    logits = index_logits_reference(q, weights, k_cache, kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids,
                                    k_scale=k_scale)
    return topk_reference(logits, kv_lens.astype(jnp.int32), topk)


def pallas_problem(index_heads: int, head_dim: int, page_size: int = 64) -> str | None:
    """Why the compiled logits kernel cannot take these shapes (its q tile is [index_heads, head_dim]; its key
    tiles are whole pages, so the page size, which is the sequence length of a contiguous cache, is a power of
    two)."""
    return first_problem(pow2_tile_problem("index_n_heads", index_heads),
                         pow2_tile_problem("index_head_dim", head_dim),
                         pow2_tile_problem("page_size (contiguous cache: its length)", page_size, minimum=1))


def visible_prefix(kv_lens, topk: int):
    """int32[T, topk]: positions 0 .. kv_lens-1 of each query, then −1: the selection when k is at least the number
    of keys a query can see."""
    positions = jnp.arange(topk, dtype=jnp.int32)[None, :]
    return jnp.where(positions < kv_lens.astype(jnp.int32)[:, None], positions, -1)


def indexer_topk(q, weights, k_cache, *, kv_lens, topk: int, page_table=None, seq_ids=None, k_scale=None,
                 impl: str = "auto", interpret: bool = False):
    """Top-k key positions per query; see the module docstring for layouts. Returns int32[T, topk], −1 padded.

    When topk covers every key the cache holds for a query (the table's row, or a contiguous row), nothing needs
    scoring: every visible key is selected, listed in order (`visible_prefix`), which is one valid output of the
    selection (its order is unspecified) and costs no logits."""
    kv_lens = kv_lens.astype(jnp.int32)
    page_size = k_cache.shape[1]
    if topk >= page_size * (page_table.shape[1] if page_table is not None else 1):
        return visible_prefix(kv_lens, topk)
    problem = first_problem(pallas_problem(q.shape[1], q.shape[2], page_size), fp8_problem(k_cache))
    if resolve_impl(impl, interpret, problem, "indexer_topk") == "xla":
        return indexer_topk_reference(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                                      seq_ids=seq_ids, k_scale=k_scale)
    return indexer_topk_pallas(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                               seq_ids=seq_ids, k_scale=k_scale, interpret=interpret)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernels
# ----------------------------------------------------------------------------------------------------------------

def _index_logits_kernel(seq_ref, lens_ref, pt_ref, q_ref, w_ref, k_ref, *rest, block_q, block_kv, tiles_per_program,
                         page_size, max_pages, fp8, byte_pairs, group):
    ks_ref = rest[0] if fp8 else None
    o_ref, *gmax_out = rest[1:] if fp8 else rest
    t0 = pl.program_id(0) * block_q
    span0 = pl.program_id(1) * block_kv * tiles_per_program
    lens = [lens_ref[t0 + i] for i in range(block_q)]
    longest = functools.reduce(jnp.maximum, lens)
    d = k_ref.shape[-1]
    key_dtype = jnp.bfloat16 if fp8 else k_ref.dtype  # e4m3 keys are widened to bf16 (exactly) for the dot

    def write(t, j0, row, n_valid):
        pos = j0 + jnp.arange(block_kv)
        o_ref[t, pl.ds(j0, block_kv)] = jnp.where(pos < n_valid, row, -jnp.inf)
        if gmax_out:
            # The select kernel's group maxima, from the tile in registers: it then never reads a row for them.
            gmax_out[0][t, pl.ds(j0 // group, block_kv // group)] = masked_keys_and_group_max(
                row, pos, n_valid, group)[1]

    def load_tile(s, j0):
        # Logical positions -> flat cache rows through the page table (gathered per key, so any power-of-two
        # page size works, also pages smaller than the tile). Pages past the table are clamped; their keys are
        # masked by kv_lens anyway.
        pos = j0 + jnp.arange(block_kv)
        page_slot = jnp.minimum(pos // page_size, max_pages - 1)
        pages = plgpu.load(pt_ref.at[jnp.full((block_kv,), s, jnp.int32), page_slot])
        rows = pages * page_size + pos % page_size
        tile = plgpu.load(k_ref.at[rows[:, None], jnp.arange(d)[None, :]])
        if byte_pairs:  # the even and the odd channels' keys
            return tuple(half.astype(jnp.bfloat16) for half in split_byte_pairs(tile)), plgpu.load(ks_ref.at[rows])
        if fp8:
            return (tile.astype(jnp.bfloat16),), plgpu.load(ks_ref.at[rows])
        return (tile,), jnp.ones((block_kv,), jnp.float32)

    def compute_tile(j0, queries):
        seq_prev = seq_ref[t0]
        tile = load_tile(seq_prev, j0)
        for i, (q_parts, w) in enumerate(queries):
            t = t0 + i
            if i:
                s = seq_ref[t]
                # A query block may straddle two sequences of a packed batch: reload the tile only then.
                tile = lax.cond(s != seq_prev, lambda s=s: load_tile(s, j0), lambda tile=tile: tile)
                seq_prev = s
            k_parts, k_scale = tile
            scores = functools.reduce(jnp.add, [
                lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=dot_precision(k.dtype)) for q, k in zip(q_parts, k_parts)])
            write(t, j0, jnp.sum(jnp.maximum(scores, 0.0) * w[:, None], axis=0) * k_scale, lens[i])

    def masked_tile(j0):
        for i in range(block_q):
            write(t0 + i, j0, jnp.zeros((block_kv,), jnp.float32), 0)

    @pl.when(span0 < longest)
    def _compute():
        # The queries' q and weights once per program, for all of its key tiles; with byte pairs q in two halves,
        # its even channels then its odd ones (index_logits_pallas reorders them).
        halves = [pl.ds(0, d), pl.ds(d, d)] if byte_pairs else [slice(None)]
        queries = [(tuple(q_ref[t0 + i, :, half].astype(key_dtype) for half in halves),
                    w_ref[t0 + i, :].astype(jnp.float32)) for i in range(block_q)]
        if tiles_per_program == 1:
            compute_tile(span0, queries)
            return

        def one_tile(j, carry):
            j0 = pl.multiple_of(span0 + j * block_kv, block_kv)
            pl.when(j0 < longest)(lambda: compute_tile(j0, queries))
            pl.when(j0 >= longest)(lambda: masked_tile(j0))
            return carry

        lax.fori_loop(0, tiles_per_program, one_tile, 0)

    @pl.when(span0 >= longest)
    def _masked():
        for j in range(tiles_per_program):
            masked_tile(span0 + j * block_kv)


def index_logits_pallas(q, weights, k_cache, *, kv_lens, page_table=None, seq_ids=None, k_scale=None,
                        n_pad: int | None = None, block_q: int | None = None, block_kv: int = 128,
                        tiles_per_program: int | None = None, num_warps: int = 4, group_max: int = 0,
                        byte_pairs: bool | None = None, interpret: bool = False):
    """float32 logits [T_pad, n_pad] (rows past T and columns past the page table are -inf / padding).

    Each program scores `block_q` queries against `tiles_per_program` key tiles of `block_kv`, loading the queries
    once (n_pad must be a multiple of block_kv * tiles_per_program). By default decode takes 4 tiles a program where
    they divide the row: on the H200 at 131k keys, 3-5% less time at 16 and 32 queries, the same at 1
    (`bash bench/lab/h200_runs.sh idx_decode`, 2026-12-01).
    FP8 keys in a pool past 2^31 elements go in as byte pairs (`_dispatch.needs_byte_pairs`; `byte_pairs` forces
    them on or off): each pair tile splits into the even and the odd channels' keys, dotted with q's even and odd
    channels.
    With `group_max = G > 0` also the rows' group maxima (`topk_select.masked_keys_and_group_max`) int32
    [T_pad, n_pad / G], returned as (logits, gmax) for `select_topk_pallas(..., gmax=)`."""
    T, Hi, D = q.shape
    k_cache, k_scale, page_table, seq_ids = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    num_pages, page_size, _ = k_cache.shape
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    max_pages = page_table.shape[1]
    n_keys = max_pages * page_size
    n_pad = n_pad or n_keys
    block_kv = min(block_kv, n_pad)
    if group_max and block_kv % group_max:
        raise ValueError(f"the key tile {block_kv} must hold whole groups of {group_max}")
    if block_q is None:
        # Decode (one query per sequence) gains nothing from blocking queries; prefill reuses each K tile 4x.
        block_q = 4 if T >= 64 else 1
    if tiles_per_program is None:
        tiles_per_program = 4 if block_q == 1 and not n_pad % (4 * block_kv) else 1
    if n_pad % (block_kv * tiles_per_program):
        raise ValueError(f"{n_pad} columns are no whole number of programs of {tiles_per_program} x {block_kv} keys")
    t_pad = pl.cdiv(T, block_q) * block_q
    pad_t = t_pad - T
    q = jnp.pad(q, ((0, pad_t), (0, 0), (0, 0)))
    weights = jnp.pad(weights.astype(jnp.float32), ((0, pad_t), (0, 0)))
    lens = jnp.pad(jnp.minimum(kv_lens, n_keys).astype(jnp.int32), (0, pad_t))
    seqs = jnp.pad(seq_ids, (0, pad_t))
    k_flat = k_cache.reshape(num_pages * page_size, D)
    fp8 = k_cache.dtype == jnp.float8_e4m3fn
    if fp8 and k_scale is None:
        raise ValueError("an FP8 index-K cache needs k_scale")
    byte_pairs = fp8 and (needs_byte_pairs(k_flat) if byte_pairs is None else byte_pairs)
    if byte_pairs:
        if D % 2:
            raise ValueError(f"FP8 keys as byte pairs need an even head dim, got {D}")
        k_flat = as_byte_pairs(k_flat)
        q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
    args = [seqs, lens, page_table, q, weights, k_flat]
    if fp8:
        args.append(k_scale.reshape(num_pages * page_size).astype(jnp.float32))
    out_shape = [jax.ShapeDtypeStruct((t_pad, n_pad), jnp.float32)]
    if group_max:
        out_shape.append(jax.ShapeDtypeStruct((t_pad, n_pad // group_max), jnp.int32))
    kernel = functools.partial(_index_logits_kernel, block_q=block_q, block_kv=block_kv,
                               tiles_per_program=tiles_per_program, page_size=page_size, max_pages=max_pages,
                               fp8=fp8, byte_pairs=byte_pairs, group=group_max)
    out = pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, n_pad // (block_kv * tiles_per_program)),
        out_shape=tuple(out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="index_logits",
    )(*args)
    return tuple(out) if group_max else out[0]


# Whether the indexer's logits kernel also writes the group maxima the select searches (saves the select one read
# of every logits row); False restores the select's own pass.
FUSE_GROUP_MAX = True
# Few rows (decode batches) leave the select kernel, one program per row, with most SMs idle, and a row past 2^17
# keys has more group maxima than its registers hold (it then counts them from L2, pass after pass: 0.49 ms a call
# at B=16 over 131k keys on the H200). Such rows are selected in segments of a power-of-two length: each segment's
# top-k by its own program, about SPLIT_TARGET_PROGRAMS of them in all, then the top-k of the segments' candidates,
# one program per row. Exact: a row's top-k lies in the union of its segments' top-k (ties included, since each
# segment keeps its lowest positions and the candidates stay in position order, as the final pass needs).
SPLIT_TARGET_PROGRAMS = 128
MIN_SEGMENT_PER_K = 4  # segments of at least 4 * next_pow2(k) keys: shorter ones make the final pass the larger part


def select_segments(n_rows: int, n_keys: int, topk: int) -> tuple[int, int] | None:
    """(segments, keys per segment) of a split selection over rows of n_keys, or None for one program per row."""
    shortest = MIN_SEGMENT_PER_K * next_pow2(topk)
    wanted = min(SPLIT_TARGET_PROGRAMS // max(n_rows, 1), n_keys // shortest)
    if wanted < 2:
        return None
    seg_len = max(next_pow2(pl.cdiv(n_keys, wanted) + 1) // 2, shortest)  # the power of two at or below
    segments = pl.cdiv(n_keys, seg_len)
    return (segments, seg_len) if segments > 1 else None


def select_topk_in_segments(logits, gmax, kv_lens, topk: int, *, segments: int, chunk: int, interpret: bool,
                            **select_options):
    """`select_topk_pallas` over rows of logits [R, segments * L] (gmax [R, segments * L / GROUP]) split into
    segments of L: each segment's top-k, then the top-k among them. Rows with at most topk visible keys take them
    all (`visible_prefix`)."""
    rows, n_pad = logits.shape
    seg_len = n_pad // segments
    starts = jnp.arange(segments, dtype=jnp.int32) * seg_len
    seg_lens = jnp.clip(kv_lens[:, None] - starts[None, :], 0, seg_len).reshape(-1)
    local = select_topk_pallas(logits.reshape(rows * segments, seg_len), seg_lens, topk,
                               gmax=gmax.reshape(rows * segments, seg_len // GROUP), chunk=min(chunk, seg_len),
                               interpret=interpret, **select_options)
    # Candidates in position order; a segment's unused entries (−1) score -inf, below the >= topk finite candidates
    # of every row that reaches this pass.
    candidates = jnp.where(local >= 0, local + jnp.tile(starts, rows)[:, None], -1).reshape(rows, segments * topk)
    n_cand = segments * topk
    chunk2 = min(chunk, next_pow2(n_cand))
    width = pl.cdiv(n_cand, chunk2) * chunk2
    candidates = jnp.pad(candidates, ((0, 0), (0, width - n_cand)), constant_values=-1)
    scores = jnp.take_along_axis(logits, jnp.maximum(candidates, 0), axis=1)
    scores = jnp.where(candidates >= 0, scores, -jnp.inf)
    best = select_topk_pallas(scores, jnp.full((rows,), width, jnp.int32), topk, chunk=chunk2, interpret=interpret)
    picked = jnp.where(best >= 0, jnp.take_along_axis(candidates, jnp.maximum(best, 0), axis=1), -1)
    return jnp.where((kv_lens > topk)[:, None], picked, visible_prefix(kv_lens, topk))


def indexer_topk_pallas(q, weights, k_cache, *, kv_lens, topk, page_table=None, seq_ids=None, k_scale=None,
                        interpret=False, chunk: int = 2048, block_q: int | None = None,
                        fuse_group_max: bool | None = None, split: bool | None = None,
                        logits_options: dict | None = None, **select_options):
    """Logits kernel then select kernel; `logits_options` go to `index_logits_pallas` (block_kv, tiles_per_program,
    num_warps), `select_options` to `select_topk_pallas` (tiles, digit_bits, ...). `split`: False never selects in
    segments; otherwise `select_segments` decides (where it pays)."""
    T = q.shape[0]
    fuse = FUSE_GROUP_MAX if fuse_group_max is None else fuse_group_max
    k_cache_n, _, page_table_n, _ = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    n_keys = page_table_n.shape[1] * k_cache_n.shape[1]
    chunk = min(chunk, max(16, next_pow2(n_keys)))
    n_pad = pl.cdiv(n_keys, chunk) * chunk
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), n_keys)
    segmented = select_segments(T, n_keys, topk) if split is not False and fuse else None
    tiles = {}
    if segmented:
        n_pad = segmented[0] * segmented[1]
        tiles = dict(block_kv=min(128, segmented[1]))  # key tiles within a segment
    logits = index_logits_pallas(q, weights, k_cache, kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids,
                                 k_scale=k_scale, n_pad=n_pad, block_q=block_q, group_max=GROUP if fuse else 0,
                                 interpret=interpret, **{**tiles, **(logits_options or {})})
    logits, gmax = logits if fuse else (logits, None)
    if segmented:
        return select_topk_in_segments(logits[:T], gmax[:T], kv_lens, topk, segments=segmented[0], chunk=chunk,
                                       interpret=interpret, **select_options)
    return select_topk_pallas(logits, kv_lens, topk, gmax=gmax, n_rows=T, chunk=chunk, interpret=interpret,
                              **select_options)
