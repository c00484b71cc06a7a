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
  1. `_index_logits`: grid (query blocks × key blocks). Each program loads one key tile per sequence present in its
     query block (K tile reused by all its queries), does `[Hi, D] @ [D, KB]` on the tensor cores per query,
     relu, weights, head-sum, FP8 scale, masks with -inf past `kv_lens`, and skips tiles past the block's
     longest row. Writes float32 logits `[T, Npad]`.
  2. `_select_topk`: one program per row; an exact selection without sorting:
     a. pass over the row: order-preserving int32 keys, max over groups of G=4 keys -> `gmax` (scratch);
     b. binary search (32 counting passes over `gmax`, N/4 values, held in registers when N/4 <= 16384, else
        re-read from L2 chunk by chunk) for the k-th largest group max `t_lo`. At
        least k groups hold a key >= t_lo, so the k-th largest key is >= t_lo, and keys >= t_lo sit in at most
        ~k groups: at most 4k candidates (more only with ties at t_lo);
     c. second pass over the row compacts candidates (key, position) with a prefix sum into a 4k scratch;
     d. binary search on the bit pattern (32 counting passes over <= 4k candidates) for the exact k-th largest
        key T*, then one compaction pass writes every candidate > T* plus the first ties == T*.
     If ties overflow the 4k scratch (rare: many equal logits), the row falls back to the same search and
     compaction over the whole row. Work per row: two reads of the row plus 32 passes over N/4 + 4k values,
     against a full sort's log²N passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import dot_precision, first_problem, next_pow2, pow2_tile_problem, resolve_impl

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


def indexer_topk(q, weights, k_cache, *, kv_lens, topk: int, page_table=None, seq_ids=None, k_scale=None,
                 impl: str = "auto", interpret: bool = False):
    """Top-k key positions per query; see the module docstring for layouts. Returns int32[T, topk], −1 padded."""
    kv_lens = kv_lens.astype(jnp.int32)
    page_size = k_cache.shape[1]
    if resolve_impl(impl, interpret, pallas_problem(q.shape[1], q.shape[2], page_size), "indexer_topk") == "xla":
        return indexer_topk_reference(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                                      seq_ids=seq_ids, k_scale=k_scale)
    return indexer_topk_pallas(q, weights, k_cache, kv_lens=kv_lens, topk=topk, page_table=page_table,
                               seq_ids=seq_ids, k_scale=k_scale, interpret=interpret)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernels
# ----------------------------------------------------------------------------------------------------------------

_INT_MIN = -(2**31)
_INT_MAX = 2**31 - 1
_GROUP = 4  # keys per group in the first-pass group maxima (candidates <= _GROUP * topk)


def _index_logits_kernel(seq_ref, lens_ref, pt_ref, q_ref, w_ref, k_ref, *rest, block_q, block_kv, page_size,
                         max_pages, fp8):
    if fp8:
        ks_ref, o_ref = rest
    else:
        (o_ref,) = rest
    t0 = pl.program_id(0) * block_q
    j0 = pl.program_id(1) * block_kv
    pos = j0 + jnp.arange(block_kv)
    lens = [lens_ref[t0 + i] for i in range(block_q)]
    longest = functools.reduce(jnp.maximum, lens)
    d = k_ref.shape[-1]

    def load_tile(s):
        # Logical positions -> flat cache rows through the page table (gathered per key, so any power-of-two
        # page size works, also pages smaller than the tile). Pages past the table are clamped; their keys are
        # masked by kv_lens anyway.
        page_slot = jnp.minimum(pos // page_size, max_pages - 1)
        pages = plgpu.load(pt_ref.at[jnp.full((block_kv,), s, jnp.int32), page_slot])
        rows = pages * page_size + pos % page_size
        tile = plgpu.load(k_ref.at[rows[:, None], jnp.arange(d)[None, :]])
        if fp8:
            tile = tile.astype(jnp.bfloat16)  # e4m3 values are exact in bf16
            return tile, plgpu.load(ks_ref.at[rows])
        return tile, jnp.ones((block_kv,), jnp.float32)

    @pl.when(j0 < longest)
    def _compute():
        seq_prev = seq_ref[t0]
        tile = load_tile(seq_prev)
        for i in range(block_q):
            t = t0 + i
            if i:
                s = seq_ref[t]
                # A query block may straddle two sequences of a packed batch: reload the tile only then.
                tile = lax.cond(s != seq_prev, lambda s=s: load_tile(s), lambda tile=tile: tile)
                seq_prev = s
            k_tile, k_scale = tile
            q = q_ref[t, :, :]
            if q.dtype != k_tile.dtype:
                q = q.astype(k_tile.dtype)
            scores = lax.dot_general(q, k_tile, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                     precision=dot_precision(k_tile.dtype))
            w = w_ref[t, :].astype(jnp.float32)
            row = jnp.sum(jnp.maximum(scores, 0.0) * w[:, None], axis=0) * k_scale
            o_ref[t, pl.ds(j0, block_kv)] = jnp.where(pos < lens[i], row, -jnp.inf)

    @pl.when(j0 >= longest)
    def _masked():
        for i in range(block_q):
            o_ref[t0 + i, pl.ds(j0, block_kv)] = jnp.full((block_kv,), -jnp.inf, jnp.float32)


def index_logits_pallas(q, weights, k_cache, *, kv_lens, page_table=None, seq_ids=None, k_scale=None,
                        n_pad: int | None = None, block_q: int | None = None, block_kv: int = 128,
                        num_warps: int = 4, interpret: bool = False):
    """float32 logits [T_pad, n_pad] (rows past T and columns past the page table are -inf / padding)."""
    T, Hi, D = q.shape
    k_cache, k_scale, page_table, seq_ids = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    num_pages, page_size, _ = k_cache.shape
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    max_pages = page_table.shape[1]
    n_keys = max_pages * page_size
    n_pad = n_pad or n_keys
    block_kv = min(block_kv, n_pad)
    if block_q is None:
        # Decode (one query per sequence) gains nothing from blocking queries; prefill reuses each K tile 4x.
        block_q = 4 if T >= 64 else 1
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
    args = [seqs, lens, page_table, q, weights, k_flat]
    if fp8:
        args.append(k_scale.reshape(num_pages * page_size).astype(jnp.float32))
    kernel = functools.partial(_index_logits_kernel, block_q=block_q, block_kv=block_kv, page_size=page_size,
                               max_pages=max_pages, fp8=fp8)
    return pl.pallas_call(
        kernel,
        grid=(t_pad // block_q, n_pad // block_kv),
        out_shape=jax.ShapeDtypeStruct((t_pad, n_pad), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="index_logits",
    )(*args)


def _order_key(x):
    """float32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    u = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(u >= 0, u, u ^ jnp.int32(_INT_MAX))


def _kth_largest_key(count_ge, k):
    """Largest int32 t with count_ge(t) >= k: binary search over the 32-bit range, one counting pass per bit."""

    def step(_, lohi):
        lo, hi = lohi  # invariant: count_ge(lo) >= k > count_ge(hi)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
        ok = count_ge(mid) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = lax.fori_loop(0, 32, step, (jnp.int32(_INT_MIN + 1), jnp.int32(_INT_MAX)))
    return lo


def _select_kernel(lens_ref, logit_ref, out_ref, gmax_ref, ckey_ref, cidx_ref, *, n_cols, topk, topk_pad, chunk,
                   cap, gmax_in_registers, interpret):
    def barrier():
        # Scratch written by some threads of the program is read back by others: order it on the GPU (the
        # interpreter runs a program sequentially and has no barrier primitive).
        if not interpret:
            plgpu.debug_barrier()

    t = pl.program_id(0)
    n_valid = jnp.minimum(lens_ref[t], n_cols)
    k_eff = jnp.minimum(n_valid, topk)
    n_chunks = pl.cdiv(n_valid, chunk)  # chunks past the row's last valid key are never read
    gchunk = chunk // _GROUP
    out_ref[t, :] = jnp.full((topk_pad,), -1, jnp.int32)

    def row_chunk(c):
        start = c * chunk
        pos = start + jnp.arange(chunk, dtype=jnp.int32)
        key = _order_key(logit_ref[t, pl.ds(start, chunk)])
        return jnp.where(pos < n_valid, key, _INT_MIN), pos

    def select(load_chunk, nchunks):
        """Write the k_eff largest keys' positions (ties: lowest positions first) into out_ref[t]."""

        def count(pred):
            return lax.fori_loop(0, nchunks, lambda c, n: n + jnp.sum(pred(load_chunk(c)[0]).astype(jnp.int32)),
                                 jnp.int32(0))

        thr = _kth_largest_key(lambda mid: count(lambda key: key >= mid), k_eff)
        need_ties = k_eff - count(lambda key: key > thr)

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

    # (a, b) Lower bound t_lo on the k-th largest key from group maxima; rows that fit the candidate buffer whole
    # skip it (t_lo = smallest valid key).
    def group_bound():
        def store_gmax(c, carry):
            key, _pos = row_chunk(c)
            gmax_ref[t, pl.ds(c * gchunk, gchunk)] = jnp.max(key.reshape(gchunk, _GROUP), axis=1)
            return carry

        lax.fori_loop(0, n_chunks, store_gmax, None)
        barrier()

        n_groups = n_cols // _GROUP
        if n_groups <= gmax_in_registers and not n_groups & (n_groups - 1):
            # The whole row of group maxima fits in registers: the 32 counting passes touch no memory (a loop
            # over L2-resident chunks is bound by load latency, one dependent load + reduction per step).
            lane = jnp.arange(n_groups, dtype=jnp.int32)
            g = plgpu.load(gmax_ref.at[t, pl.ds(0, n_groups)], mask=lane < n_chunks * gchunk, other=_INT_MIN)

            def count_ge(mid):
                return jnp.sum((g >= mid).astype(jnp.int32))
        else:
            def count_ge(mid):
                return lax.fori_loop(
                    0, n_chunks,
                    lambda c, n: n + jnp.sum((gmax_ref[t, pl.ds(c * gchunk, gchunk)] >= mid).astype(jnp.int32)),
                    jnp.int32(0))

        return _kth_largest_key(count_ge, k_eff)

    # (The else branch derives its constant from n_valid: Triton's cond lowering needs an IR value to yield.)
    t_lo = lax.cond(n_valid > cap, group_bound, lambda: n_valid * 0 + (_INT_MIN + 1))

    # (c) Compact candidates (key >= t_lo) in position order.
    def compact(c, base):
        key, pos = row_chunk(c)
        cand = key >= t_lo
        slot = base + jnp.cumsum(cand.astype(jnp.int32)) - 1
        keep = cand & (slot < cap)
        slot = jnp.where(keep, slot, cap)
        rows = jnp.full(slot.shape, t, jnp.int32)
        plgpu.store(ckey_ref.at[rows, slot], key, mask=keep)
        plgpu.store(cidx_ref.at[rows, slot], pos, mask=keep)
        return base + jnp.sum(cand.astype(jnp.int32))

    total = lax.fori_loop(0, n_chunks, compact, jnp.int32(0))
    barrier()

    # (d) Exact select among the candidates held in registers, or (ties overflowed the buffer) over the row.
    @pl.when(total <= cap)
    def _fast():
        lane = jnp.arange(cap, dtype=jnp.int32)
        ckey = jnp.where(lane < total, ckey_ref[t, :], _INT_MIN)
        cidx = cidx_ref[t, :]
        select(lambda c: (ckey, cidx), 1)

    @pl.when(total > cap)
    def _slow():
        select(row_chunk, n_chunks)


def select_topk_pallas(logits, kv_lens, topk: int, *, n_rows: int | None = None, chunk: int = 2048,
                       num_warps: int = 8, gmax_in_registers: int = 16384, interpret: bool = False):
    """Exact top-k positions of each row of float32 logits [R, N] among its first kv_lens[r] entries -> [n_rows,
    topk] int32, −1 padded. N must be a multiple of `chunk` (a power of two; smaller rows use one chunk)."""
    R, N = logits.shape
    n_rows = R if n_rows is None else n_rows
    chunk = min(chunk, N)
    if N % chunk or chunk & (chunk - 1) or chunk < _GROUP:
        raise ValueError(f"row length {N} must be a multiple of a power-of-two chunk {chunk} >= {_GROUP}")
    topk_pad = next_pow2(topk)
    cap = _GROUP * topk_pad
    kernel = functools.partial(_select_kernel, n_cols=N, topk=topk, topk_pad=topk_pad, chunk=chunk, cap=cap,
                               gmax_in_registers=gmax_in_registers, interpret=interpret)
    out, *_ = pl.pallas_call(
        kernel,
        grid=(n_rows,),
        out_shape=(jax.ShapeDtypeStruct((n_rows, topk_pad), jnp.int32),
                   jax.ShapeDtypeStruct((n_rows, N // _GROUP), jnp.int32),  # scratch: group maxima
                   jax.ShapeDtypeStruct((n_rows, cap), jnp.int32),  # scratch: candidate keys
                   jax.ShapeDtypeStruct((n_rows, cap), jnp.int32)),  # scratch: candidate positions
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="select_topk",
    )(kv_lens.astype(jnp.int32), logits)
    return out if topk_pad == topk else out[:, :topk]


def indexer_topk_pallas(q, weights, k_cache, *, kv_lens, topk, page_table=None, seq_ids=None, k_scale=None,
                        interpret=False, chunk: int = 2048, block_q: int | None = None):
    T = q.shape[0]
    k_cache_n, _, page_table_n, _ = _normalise_layout(k_cache, k_scale, page_table, seq_ids, T)
    n_keys = page_table_n.shape[1] * k_cache_n.shape[1]
    chunk = min(chunk, max(16, next_pow2(n_keys)))
    n_pad = pl.cdiv(n_keys, chunk) * chunk
    kv_lens = jnp.minimum(kv_lens.astype(jnp.int32), n_keys)
    logits = index_logits_pallas(q, weights, k_cache, kv_lens=kv_lens, page_table=page_table, seq_ids=seq_ids,
                                 k_scale=k_scale, n_pad=n_pad, block_q=block_q, interpret=interpret)
    return select_topk_pallas(logits, kv_lens, topk, n_rows=T, chunk=chunk, interpret=interpret)
