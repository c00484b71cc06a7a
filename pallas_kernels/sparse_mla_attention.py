"""Sparse absorbed-MLA attention (DeepSeek-V3.2 DSA): each query attends only to its top-k selected latent entries.

`sparse_mla_attention(q[T, H, Dl+Dr], latent_cache, indices[T, topk], *, scale) -> [T, H, Dl]`

Layouts:
  * `latent_cache[num_pages, page_size, Dl+Dr]` (any leading shape works: it is viewed as flat rows
    `[num_pages * page_size, Dl+Dr]`). Row = compressed KV latent (Dl = 512) followed by the roped key part
    (Dr = 64). Key = the whole row, value = its first Dl entries (absorbed MLA).
  * `indices[T, topk]` int32 **flat cache rows** (`page * page_size + offset`), −1 = no key. `indexer_topk`
    returns logical positions; `logical_to_cache_rows(idx, page_table, seq_ids, page_size)` translates them
    (a contiguous per-sequence cache `[S, L, Dl+Dr]` is the paged form with `page_table = arange(S)[:, None]`).
  * `q` is the absorbed query (`q_nope · W_UK` concatenated with `q_pe`); `scale` is the softmax scale.
A query whose indices are all −1 gets zeros. Softmax is online, in float32; the output has q's dtype.

Pallas kernel (Triton lowering): grid (H / BH, S, T). A program holds BH heads of one query (heads are the
matmul M dimension: every head shares the query's index list) and walks one of S splits of its top-k list in
chunks of BK: gathers BK latent rows (the row pointers come from the index chunk), scores
`q_nope·kv[:, :Dl] + q_rope·kv[:, Dl:]` on the tensor cores, online-softmax update of a float32 [BH, Dl]
accumulator, `P @ kv[:, :Dl]`. Both dots reuse the one gathered tile, so the bytes read are the selected rows once
per head block (the head blocks of one query are adjacent in the grid and share them through L2).

Prefill chunks have T·H/BH programs to spare and take S = 1. Decode batches have few queries, so the list is split
(flash-decoding): S > 1 programs per (query, head block) each write a normalised partial output and its
log-sum-exp in float32, and an XLA combine weighs them (`_combine_splits`). Given `listed` (how many entries lead
each list, the rest being −1, as the indexer lays them out) a program walks only the chunks that hold them; without
it, `trim` finds a split's last listed index by loading the split's indices at once. Either way a decode over a
context shorter than k gathers only what the indexer listed.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import dot_precision, fit_stages, is_hopper, next_pow2, on_gpu, pow2_tile_problem, resolve_impl
from ._mosaic import mosaic_kernels_available, mosaic_lowering_available
from .sparse_mla_mosaic import mosaic_problem, sparse_mla_decode_mosaic

# Which compiled kernel `auto` runs on the GPU: "mosaic" (the Hopper kernel of `sparse_mla_mosaic`, where jax has
# Mosaic GPU, the GPU is a Hopper and the shapes and dtypes fit it; the Triton kernel elsewhere) or "triton"
# (`sparse_mla_attention_pallas` everywhere). On the H200 the Mosaic kernel decodes top-2048 at 128 heads in 0.017 /
# 0.050 / 0.156 ms at B = 1 / 32 / 128 against Triton's 0.036 / 0.179 / 0.308, and a 2,048-query prefill chunk in
# 4.85 ms as Triton does, on its owner schedule (8 splits of 4 blocks; docs/BENCHMARKS.md).
KERNEL = os.environ.get("JAXMODELS_SPARSE_MLA_KERNEL", "mosaic")


def logical_to_cache_rows(indices, page_table, seq_ids, page_size: int):
    """Logical positions [T, k] (−1 = none) of the query's sequence -> flat cache rows [T, k] (−1 kept)."""
    pages = page_table[seq_ids[:, None], jnp.maximum(indices, 0) // page_size]
    rows = pages * page_size + jnp.maximum(indices, 0) % page_size
    return jnp.where(indices >= 0, rows, -1).astype(jnp.int32)


def sparse_mla_attention_reference(q, latent_cache, indices, *, scale: float, kv_lora_rank: int = 512):
    """Gather the selected rows, masked softmax in float32, weighted sum of the first Dl dims."""
    D = q.shape[-1]
    flat = latent_cache.reshape(-1, D)
    valid = indices >= 0
    kv = flat[jnp.maximum(indices, 0)].astype(jnp.float32)  # [T, k, D]
    s = jnp.einsum("thd,tkd->thk", q.astype(jnp.float32), kv, precision=lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)  # exp(-inf) = 0 for the masked entries
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("thk,tkc->thc", p, kv[..., :kv_lora_rank], precision=lax.Precision.HIGHEST)
    out = jnp.where(l > 0, out / jnp.where(l > 0, l, 1.0), 0.0)
    return out.astype(q.dtype)


def _sparse_mla_kernel(idx_ref, *refs, scale, dl, dr, block_h, block_k, split_len, trim, counted):
    count_ref, q_ref, kv_ref, *out_refs = refs if counted else (None, *refs)
    h0 = pl.program_id(0) * block_h
    split = pl.program_id(1)
    t = pl.program_id(2)
    k0 = split * split_len
    q_nope = q_ref[t, pl.ds(h0, block_h), pl.ds(0, dl)]
    q_rope = q_ref[t, pl.ds(h0, block_h), pl.ds(dl, dr)]
    cols_l = jnp.arange(dl)[None, :]
    cols_r = dl + jnp.arange(dr)[None, :]
    nt = (((1,), (1,)), ((), ()))  # contract the feature dim of both: q @ k.T

    def body(c, carry):
        m, l, acc = carry
        idx = idx_ref[t, pl.ds(k0 + c * block_k, block_k)]
        valid = idx >= 0
        rows = jnp.where(valid, idx, 0)[:, None]
        kv = plgpu.load(kv_ref.at[rows, cols_l])  # [BK, Dl] gathered latent rows
        kr = plgpu.load(kv_ref.at[rows, cols_r])  # [BK, Dr]
        s = lax.dot_general(q_nope, kv, nt, preferred_element_type=jnp.float32, precision=dot_precision(kv.dtype))
        s = s + lax.dot_general(q_rope, kr, nt, preferred_element_type=jnp.float32,
                                precision=dot_precision(kr.dtype))
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # Keep exp() finite while every key seen so far is masked (m_new = -inf).
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(kv.dtype), kv, preferred_element_type=jnp.float32,
                                             precision=dot_precision(kv.dtype))
        return m_new, l, acc

    if counted:
        # The list's first `listed` entries are its keys: walk the chunks of this split that hold any.
        in_split = jnp.clip(count_ref[t] - k0, 0, split_len)
        n_chunks = (in_split + block_k - 1) // block_k
    elif trim:
        # Walk only up to the split's last listed key: the indexer lists its keys first and pads with −1, so short
        # contexts (and the splits past them) cost no gathers.
        listed = idx_ref[t, pl.ds(k0, split_len)] >= 0
        used = jnp.max(jnp.where(listed, jnp.arange(1, split_len + 1, dtype=jnp.int32), 0))
        n_chunks = (used + block_k - 1) // block_k
    else:
        n_chunks = split_len // block_k
    init = (jnp.full((block_h,), -jnp.inf, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            jnp.zeros((block_h, dl), jnp.float32))
    m, l, acc = lax.fori_loop(0, n_chunks, body, init)
    some = l > 0
    out = jnp.where(some[:, None], acc / jnp.where(some, l, 1.0)[:, None], 0.0)
    if len(out_refs) == 1:  # the whole list in one program: the output itself
        (o_ref,) = out_refs
        o_ref[t, pl.ds(h0, block_h), :] = out.astype(o_ref.dtype)
    else:  # one split's softmax state: normalised partial output and log-sum-exp, combined by `_combine_splits`
        po_ref, lse_ref = out_refs
        po_ref[t, split, pl.ds(h0, block_h), :] = out
        lse_ref[t, split, pl.ds(h0, block_h)] = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)


def _combine_splits(partial_out, lse, dtype):
    """Softmax-weighted sum of the splits' normalised outputs [T, S, H, Dl] by their log-sum-exps [T, S, H]."""
    top = jnp.max(lse, axis=1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # every split empty: all weights 0, output 0
    w = jnp.exp(lse - top)
    total = jnp.sum(w, axis=1)
    out = jnp.sum(w[..., None] * partial_out, axis=1)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0).astype(dtype)


# Prefill chunks and large decode batches (many queries) in 16-bit: 64-row gathers, 3 stages in flight. Measured on
# the H200 at H=128, top-2048 (`bench/dsa_kernels.py --only mla_prefill` / `--only mla_decode --mla-batches 128`):
# T=2048, 5.6 ms against 10.3 ms for the decode tiles; T=128, 0.333 ms against 0.636 (splitting the list in two:
# 0.370). The three stages of a 64 x 576 16-bit tile take 216 KiB of shared memory, so float32 keeps the small tiles.
PREFILL_TILES = dict(block_k=64, num_stages=3, num_splits=1, trim=False)
PREFILL_MIN_QUERIES = 128
# Decode (few queries): the top-k list is split over programs until about DECODE_TARGET_PROGRAMS run (two per SM
# of the H200's 132), each split at least MIN_KEYS_PER_SPLIT keys. DECODE_TARGET_PROGRAMS = 0: one program per
# (query, head block), the layout before splitting.
DECODE_TARGET_PROGRAMS = 264
MIN_KEYS_PER_SPLIT = 256


def decode_splits(num_queries: int, *, heads: int, topk: int, block_h: int = 32) -> int:
    """How many programs share one query's top-k list (a power of two: 2048-key lists split evenly)."""
    programs = num_queries * max(heads // block_h, 1)
    wanted = next_pow2(pl.cdiv(DECODE_TARGET_PROGRAMS, programs)) if DECODE_TARGET_PROGRAMS else 1
    most = 1 << (max(topk // MIN_KEYS_PER_SPLIT, 1).bit_length() - 1)
    return max(1, min(wanted, most))


def default_tiles(num_queries: int, dtype, *, heads: int, topk: int, block_h: int = 32, width: int = 576) -> dict:
    """Tiles for `num_queries` queries over latent rows of `width` values (512 + 64 in DeepSeek-V3.2) in `dtype`."""
    if num_queries >= PREFILL_MIN_QUERIES and jnp.dtype(dtype).itemsize == 2:
        tiles = dict(PREFILL_TILES)
        tiles["num_stages"] = fit_stages(tiles["num_stages"], tiles["block_k"] * width * jnp.dtype(dtype).itemsize)
        return tiles
    return dict(block_k=32, num_stages=1, trim=True,
                num_splits=decode_splits(num_queries, heads=heads, topk=topk, block_h=block_h))


def sparse_mla_attention_pallas(q, latent_cache, indices, *, scale: float, kv_lora_rank: int = 512,
                                listed=None, block_h: int = 32, block_k: int | None = None, num_warps: int = 4,
                                num_stages: int | None = None, num_splits: int | None = None,
                                trim: bool | None = None, interpret: bool = False):
    """Grid (head blocks, splits of the top-k list, queries); options left None take `default_tiles`. With
    `listed` (see `sparse_mla_attention`) a program walks only the chunks that hold listed keys, and `trim` is
    moot."""
    T, H, D = q.shape
    topk = indices.shape[1]
    block_h = min(block_h, H)
    if H % block_h:
        raise ValueError(f"heads {H} must be a multiple of block_h {block_h}")
    tiles = default_tiles(T, latent_cache.dtype, heads=H, topk=topk, block_h=block_h, width=D)
    block_k = tiles["block_k"] if block_k is None else block_k
    num_stages = tiles["num_stages"] if num_stages is None else num_stages
    num_splits = tiles["num_splits"] if num_splits is None else num_splits
    trim = (tiles["trim"] if trim is None else trim) and listed is None
    dl, dr = kv_lora_rank, D - kv_lora_rank
    # Each split is a whole number of BK chunks; trimming loads a split's indices at once (a power of two).
    split_len = pl.cdiv(pl.cdiv(topk, num_splits), block_k) * block_k
    if trim:
        split_len = next_pow2(split_len)
    flat = latent_cache.reshape(-1, D)
    indices = jnp.pad(indices.astype(jnp.int32), ((0, 0), (0, num_splits * split_len - topk)), constant_values=-1)
    kernel = functools.partial(_sparse_mla_kernel, scale=float(scale), dl=dl, dr=dr, block_h=block_h,
                               block_k=block_k, split_len=split_len, trim=trim, counted=listed is not None)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((T, H, dl), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((T, num_splits, H, dl), jnp.float32),
                     jax.ShapeDtypeStruct((T, num_splits, H), jnp.float32))
    out = pl.pallas_call(
        kernel,
        # Head blocks innermost: the programs that gather the same rows (one query's split) run side by side and
        # share them through L2.
        grid=(H // block_h, num_splits, T),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_mla_attention",
    )(indices, *([] if listed is None else [listed.astype(jnp.int32)]), q, flat)
    return out if num_splits == 1 else _combine_splits(*out, q.dtype)


def pallas_problem(heads: int, latent_dim: int, rope_dim: int, block_h: int = 32) -> str | None:
    """Why the compiled kernel cannot take these shapes (tiles [min(block_h, heads), latent or rope dim])."""
    if heads % min(block_h, heads):
        return f"heads={heads} is not a multiple of the head block {block_h}"
    return (pow2_tile_problem("heads per block", min(block_h, heads)) or pow2_tile_problem("kv_lora_rank", latent_dim)
            or pow2_tile_problem("qk_rope_head_dim", rope_dim))


def _takes_mosaic(impl: str, interpret, q, latent_cache, kv_lora_rank: int) -> bool:
    """Whether this call runs the Mosaic GPU kernel: asked for by name (impl="mosaic", which raises where it cannot
    run), or under `auto` on a Hopper GPU when KERNEL says so and the shapes fit it."""
    if impl != "mosaic" and not (impl == "auto" and KERNEL == "mosaic" and on_gpu() and not interpret):
        return False
    problem = mosaic_problem(q.shape[1], q.shape[2], kv_lora_rank, q.dtype, latent_cache.dtype)
    if interpret:  # Mosaic GPU's interpreter, on any machine
        problem = problem or (None if mosaic_lowering_available() else "this jax has no Mosaic GPU backend")
    else:
        problem = (problem or (None if on_gpu() else "it is compiled for a GPU only (interpret=True runs it on CPU)")
                   or (None if mosaic_kernels_available() else "this jax has no Mosaic GPU kernels (jax >= 0.11)")
                   or (None if is_hopper() else "the kernel uses Hopper's wgmma"))
    if impl == "mosaic" and problem:
        raise ValueError(f"the Mosaic sparse MLA kernel cannot run here: {problem}")
    return not problem


def sparse_mla_attention(q, latent_cache, indices, *, scale: float, kv_lora_rank: int = 512, listed=None,
                         impl: str = "auto", interpret=False, **kernel_options):
    """See the module docstring. `kv_lora_rank` = Dl (value width); D - Dl is the rope part. `impl`: "auto",
    "pallas" (the Triton kernel), "mosaic" (`sparse_mla_mosaic`, Hopper) or "xla" (the reference). `interpret`: run
    the kernel in its interpreter (True; for "mosaic" also Mosaic GPU's `InterpretGPUParams`, e.g. to detect races).

    `listed` (int32[T], optional): how many entries at the front of each query's list may be keys, every entry past
    them being −1, as the indexer lays its lists out (min(visible keys, k)); the kernel then gathers no chunk past
    them, which matters when k is much wider than what a query sees (every key selected over long rows)."""
    if _takes_mosaic(impl, interpret, q, latent_cache, kv_lora_rank):
        return sparse_mla_decode_mosaic(q, latent_cache.reshape(-1, q.shape[-1]), indices, scale=scale,
                                        listed=listed, num_splits=kernel_options.get("num_splits"),
                                        interpret=interpret)
    problem = pallas_problem(q.shape[1], kv_lora_rank, q.shape[2] - kv_lora_rank,
                             kernel_options.get("block_h", 32))
    if resolve_impl(impl, interpret, problem, "sparse_mla_attention") == "xla":
        return sparse_mla_attention_reference(q, latent_cache, indices, scale=scale, kv_lora_rank=kv_lora_rank)
    return sparse_mla_attention_pallas(q, latent_cache, indices, scale=scale, kv_lora_rank=kv_lora_rank,
                                       listed=listed, interpret=interpret, **kernel_options)
