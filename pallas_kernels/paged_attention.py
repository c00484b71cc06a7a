"""Causal GQA of packed queries over a paged KV cache (Nemotron-H's attention layers), as a Pallas kernel and its XLA
reference.

`paged_attention(q[T, H, d], k_pages, v_pages, *, page_table, cu_seqlens, positions, scale) -> [T, H, d]`

Semantics:
  * `k_pages`, `v_pages`: [num_pages, page_size, Hk, d]; `page_table` int32[S, max_pages]; logical position j of
    sequence s lives at row `k_pages[page_table[s, j // page_size], j % page_size]`.
  * The T queries are packed: token t < cu_seqlens[-1] belongs to the sequence s with cu_seqlens[s] <= t <
    cu_seqlens[s+1] and attends to its keys at positions 0..positions[t] inclusive. Query head h reads kv head
    h // (H // Hk). A sequence's tokens are one chunk start..start+len-1 (positions consecutive and increasing);
    keys before `start` come from earlier steps, those of the chunk were written by the caller before the call.
    Decode is the case of one token per sequence.
  * Sequences may be empty (padding sequences); tokens t >= cu_seqlens[-1] are padding and get exactly 0.
  * Cache rows past a sequence's last position may hold anything, even NaN (page 0 is the null page): such rows are
    masked as values, not only as scores, since 0 * NaN = NaN.
  * Numerics as transformers' eager attention and flash attention: scores and softmax in float32, probabilities cast
    to v's dtype for the probability-value product, float32 accumulation; float32 inputs use exact float32 dots
    (never TF32), bf16 inputs bf16 operands. The output has q's dtype.

XLA reference: gathers each token's page-table row of keys and values (everything its sequence could hold, whatever
its position), masks, and takes a two-pass float32 softmax. Exact and simple; it reads max_pages * page_size keys per
token, which is where it loses its time.

Pallas kernel (Triton lowering): grid (query blocks, kv heads, key splits).
  * Query blocks of BQ tokens are aligned to sequence starts, so a block never mixes sequences; a sequence of n tokens
    owns ceil(n / BQ) blocks, at most T // BQ + S in all (a static bound; `packing.aligned_blocks` fills the table from
    the traced cu_seqlens, unused entries have length 0 and their programs return at once).
  * A program holds its BQ tokens x the R = H // Hk query heads of its kv head as the rows of one matmul (R padded to
    a power of two Rp by masked rows, M = BQ * Rp >= 16 as Triton dots need). It loops over key tiles of BK keys from
    position 0 up to the block's last position only, gathering each key row through the page table (one pointer per
    row, so any page size works), with a per-row causal mask and an online softmax (float32 m, l, acc).
  * Decode runs through the same kernel; BQ defaults from the shape (about T / S tokens per block, at least 16 / Rp),
    so one-token sequences waste the rows of the padded tokens of their block (compute, not memory).
  * Key splits (flash decoding): with few (block, kv head) programs for the GPU, e.g. small decode batches over long
    contexts, each block's key tiles are shared out over `num_splits` programs that write a normalised partial output
    and its log-sum-exp; a small XLA combine merges them. With one split the kernel writes the output itself.
  * Padding tokens are zeroed by the last block's programs (one split) or by the combine (several splits).
Default tiles (untuned; bench/attention_kernels.py times variants): BK = 64 keys, BQ from `default_block_q` (Nano-9B:
2 tokens in decode, 16 in a prefill chunk; Nano-30B: 1 and 8), splits from `default_num_splits` (about two programs
per SM of an H200), 8 warps for 128-row tiles and 4 otherwise, 2 pipeline stages.
Shapes the compiled kernel cannot take (`pallas_problem`: head_dim, BK or BQ * Rp not a power of two >= 16) make
`impl="auto"` run the reference; interpret mode takes any shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._dispatch import dot_precision, next_pow2, pow2_tile_problem, resolve_impl
from .packing import aligned_blocks, for_each_padding_block, num_blocks_bound, token_sequences

_f32 = jnp.float32
_TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs): below that, split the keys
_MIN_TILES_PER_SPLIT = 4  # a split should own at least this many key tiles of the longest possible context
_MAX_SPLITS = 64
DEFAULT_BLOCK_K = 64


def _cdiv(a, b):
    return (a + b - 1) // b


def _check_shapes(q, k_pages, v_pages, page_table, cu_seqlens, positions):
    T, H, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, page_size, Hk, d], got {k_pages.shape} and "
                         f"{v_pages.shape}")
    Hk = k_pages.shape[2]
    if k_pages.shape[3] != d:
        raise ValueError(f"head_dim of q ({d}) and of the cache ({k_pages.shape[3]}) differ")
    if H % Hk:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {Hk}")
    S = cu_seqlens.shape[0] - 1
    if page_table.ndim != 2 or page_table.shape[0] != S:
        raise ValueError(f"page_table must be [S={S}, max_pages], got {page_table.shape}")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [T={T}], got {positions.shape}")


# ----------------------------------------------------------------------------------------------------------------
# XLA reference
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q, k_pages, v_pages, *, page_table, cu_seqlens, positions, scale: float):
    """Per-token gather of the sequence's whole page-table row, masked float32 softmax, probabilities in v's dtype."""
    _check_shapes(q, k_pages, v_pages, page_table, cu_seqlens, positions)
    T, H, d = q.shape
    Hk = k_pages.shape[2]
    R = H // Hk
    seq, _, real = token_sequences(cu_seqlens, T)
    token_pages = page_table.astype(jnp.int32)[seq]  # [T, P]
    keys = k_pages[token_pages].reshape(T, -1, Hk, d)  # [T, P * page_size, Hk, d]
    values = v_pages[token_pages].reshape(T, -1, Hk, d)
    visible = (jnp.arange(keys.shape[1])[None, :] <= positions[:, None]) & real[:, None]  # [T, J]
    # Rows past a token's position may hold NaN (unwritten rows, the null page): the scores of such keys are replaced
    # by -inf below, and their values are zeroed here so that 0 * NaN stays out of the sum.
    values = jnp.where(visible[:, :, None, None], values, 0)
    precision = dot_precision(q.dtype)
    qg = q.reshape(T, Hk, R, d)
    scores = jnp.einsum("tgrd,tjgd->tgrj", qg, keys, preferred_element_type=_f32, precision=precision) * scale
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))  # exp(-inf) = 0 for the masked keys
    l = jnp.sum(p, axis=-1, keepdims=True)
    probs = (p / jnp.where(l > 0, l, 1.0)).astype(v_pages.dtype)
    out = jnp.einsum("tgrj,tjgd->tgrd", probs, values, preferred_element_type=_f32, precision=precision)
    out = jnp.where(real[:, None, None, None], out, 0.0)  # padding tokens see no key: exactly 0
    return out.reshape(T, H, d).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------------


def _paged_attention_kernel(blk_seq_ref, blk_start_ref, blk_len_ref, cu_ref, pos_ref, pt_ref, q_ref, k_ref, v_ref,
                            *out_refs, num_tokens, num_blocks, heads, kv_heads, head_dim, page_size, max_pages,
                            block_q, r_pad, block_k, num_splits, scale, compute_dtype):
    b, g, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = heads // kv_heads
    M = block_q * r_pad
    row = lax.broadcasted_iota(jnp.int32, (M,), 0)
    row_token, row_head = row // r_pad, row % r_pad  # row = token of the block x query head of the group
    cols = lax.broadcasted_iota(jnp.int32, (head_dim,), 0)[None, :]
    length = blk_len_ref[b]
    t0 = blk_start_ref[b]
    row_real = (row_token < length) & (row_head < group)
    # Flat row of (token, head) in q / out viewed as [T * H, d]. Masked rows point past the end: Triton never touches
    # them, and interpret mode clamps such loads and drops such stores (a masked row aliasing a real row of the same
    # store would otherwise race with it there).
    qo_rows = jnp.where(row_real, (t0 + row_token) * heads + g * group + row_head, num_tokens * heads)

    @pl.when(length > 0)
    def _attend():
        s = blk_seq_ref[b]
        q = plgpu.load(q_ref.at[qo_rows[:, None], cols], mask=row_real[:, None], other=0).astype(compute_dtype)
        # Padded rows get position -1: they see no key and keep l = 0.
        row_pos = plgpu.load(pos_ref.at[t0 + row_token], mask=row_real, other=-1)
        last = pos_ref[t0 + length - 1]  # positions increase within the block: its last token sees the most keys
        num_tiles = _cdiv(last + 1, block_k)
        per_split = _cdiv(num_tiles, num_splits)
        lo = jnp.minimum(split * per_split, num_tiles)
        hi = jnp.minimum(lo + per_split, num_tiles)
        key = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        precision = dot_precision(compute_dtype)
        nt = (((1,), (1,)), ((), ()))  # contract the feature dims: q @ k.T

        def tile(c, carry):
            m, l, acc = carry
            j = c * block_k + key
            key_real = j <= last
            # Keys past `last` may be unwritten rows (NaN) or past the page-table row: their indices are clamped to
            # `last` and their loads masked to 0, so neither garbage nor NaN reaches the sums (0 * NaN = NaN).
            jc = jnp.minimum(j, last)
            page = plgpu.load(pt_ref.at[s * max_pages + jc // page_size])
            kv_rows = ((page * page_size + jc % page_size) * kv_heads + g)[:, None]
            k = plgpu.load(k_ref.at[kv_rows, cols], mask=key_real[:, None], other=0).astype(compute_dtype)
            v = plgpu.load(v_ref.at[kv_rows, cols], mask=key_real[:, None], other=0).astype(compute_dtype)
            scores = lax.dot_general(q, k, nt, preferred_element_type=_f32, precision=precision) * scale
            scores = jnp.where(j[None, :] <= row_pos[:, None], scores, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(scores, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet keep exp() finite
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(scores - m_safe[:, None])
            l = l * alpha + jnp.sum(p, axis=1)
            acc = acc * alpha[:, None] + jnp.dot(p.astype(compute_dtype), v, preferred_element_type=_f32,
                                                 precision=precision)
            return m_new, l, acc

        init = (jnp.full((M,), -jnp.inf, _f32), jnp.zeros((M,), _f32), jnp.zeros((M, head_dim), _f32))
        m, l, acc = lax.fori_loop(lo, hi, tile, init)
        out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
        if num_splits == 1:
            (o_ref,) = out_refs
            plgpu.store(o_ref.at[qo_rows[:, None], cols], out.astype(o_ref.dtype), mask=row_real[:, None])
        else:
            part_ref, lse_ref = out_refs
            part_rows = jnp.where(row_real, split * (num_tokens * heads) + qo_rows, num_splits * num_tokens * heads)
            lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            plgpu.store(part_ref.at[part_rows[:, None], cols], out, mask=row_real[:, None])
            plgpu.store(lse_ref.at[part_rows], lse, mask=row_real)

    if num_splits == 1:
        # Tokens past cu[-1] (bucket padding) belong to no block; the last block's programs zero their heads there.
        @pl.when(b == num_blocks - 1)
        def _zero_padding_tokens():
            (o_ref,) = out_refs
            zeros = jnp.zeros((M, head_dim), o_ref.dtype)

            def zero_block(t0):
                t = t0 + row_token
                pad = (t < num_tokens) & (row_head < group)
                rows = jnp.where(pad, t * heads + g * group + row_head, num_tokens * heads)
                plgpu.store(o_ref.at[rows[:, None], cols], zeros, mask=pad[:, None])

            for_each_padding_block(cu_ref, num_tokens, block_q, zero_block)


def _combine_splits(parts, lse, real_tokens, out_dtype):
    """Merge normalised partial outputs [NS, T, H, d] by their log-sum-exp [NS, T, H]; padding tokens -> 0.

    Rows of padding tokens were never written (garbage, maybe NaN): they are dropped by a select, never multiplied.
    """
    lse = jnp.where(real_tokens[None, :, None], lse, -jnp.inf)
    top = jnp.max(lse, axis=0)
    weights = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None])  # empty splits: lse = -inf -> weight 0
    parts = jnp.where(weights[..., None] > 0, parts, 0.0)
    total = jnp.sum(weights, axis=0)
    out = jnp.sum(weights[..., None] * parts, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return jnp.where(real_tokens[:, None, None], out, 0.0).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def _paged_attention_pallas(q, k_pages, v_pages, page_table, cu_seqlens, positions, *, scale, block_q, block_k,
                            num_splits, num_warps, num_stages, interpret):
    T, H, d = q.shape
    num_pages, page_size, Hk, _ = k_pages.shape
    S, max_pages = page_table.shape
    r_pad = next_pow2(H // Hk)
    blocks = aligned_blocks(cu_seqlens, T, block_q)  # blocks past the last real one have length 0
    blk_seq, blk_start, blk_len = blocks["seq"], blocks["start"], blocks["length"]
    nb = blk_seq.shape[0]
    compute_dtype = jnp.bfloat16 if v_pages.dtype == jnp.bfloat16 else _f32
    kernel = functools.partial(
        _paged_attention_kernel, num_tokens=T, num_blocks=nb, heads=H, kv_heads=Hk, head_dim=d, page_size=page_size,
        max_pages=max_pages, block_q=block_q, r_pad=r_pad, block_k=block_k, num_splits=num_splits,
        scale=float(scale), compute_dtype=compute_dtype)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((T * H, d), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits * T * H, d), _f32),
                     jax.ShapeDtypeStruct((num_splits * T * H,), _f32))
    result = pl.pallas_call(
        kernel,
        grid=(nb, Hk, num_splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention",
    )(blk_seq, blk_start, blk_len, cu_seqlens.astype(jnp.int32), positions.astype(jnp.int32),
      page_table.astype(jnp.int32).reshape(-1), q.reshape(T * H, d),
      k_pages.reshape(num_pages * page_size * Hk, d), v_pages.reshape(num_pages * page_size * Hk, d))
    if num_splits == 1:
        return result.reshape(T, H, d)
    parts, lse = result
    _, _, real = token_sequences(cu_seqlens, T)
    return _combine_splits(parts.reshape(num_splits, T, H, d), lse.reshape(num_splits, T, H), real, q.dtype)


def default_block_q(num_tokens: int, num_seqs: int, heads: int, kv_heads: int, max_rows: int = 128) -> int:
    """Tokens per query block: about the mean tokens per sequence (T / S, a power of two), with at least 16 and at
    most `max_rows` matmul rows (BQ * Rp). Decode (T = S) gets the fewest tokens that fill 16 rows."""
    r_pad = next_pow2(heads // kv_heads)
    lo = max(1, 16 // r_pad)
    hi = max(lo, max_rows // r_pad)
    return min(max(next_pow2(_cdiv(num_tokens, max(num_seqs, 1))), lo), hi)


def default_num_splits(num_tokens: int, num_seqs: int, kv_heads: int, max_keys: int, block_q: int,
                       block_k: int) -> int:
    """Key splits: double until the GPU has about `_TARGET_PROGRAMS` busy programs, while every split still owns at
    least `_MIN_TILES_PER_SPLIT` key tiles of the longest context the page table can hold. Busy blocks are estimated
    as max(S, T / BQ): one per sequence in decode, T / BQ in a long prefill chunk."""
    busy = min(num_blocks_bound(num_tokens, num_seqs, block_q), max(num_seqs, _cdiv(num_tokens, block_q)))
    splits = 1
    while (busy * kv_heads * splits < _TARGET_PROGRAMS and splits < _MAX_SPLITS
           and max_keys >= 2 * splits * _MIN_TILES_PER_SPLIT * block_k):
        splits *= 2
    return splits


def paged_attention_pallas(q, k_pages, v_pages, *, page_table, cu_seqlens, positions, scale: float, block_q=None,
                           block_k: int = DEFAULT_BLOCK_K, num_splits=None, num_warps=None, num_stages: int = 2,
                           interpret: bool = False):
    """Kernel entry point; tiles default from the shapes (`default_block_q`, `default_num_splits`; num_warps 8 for
    128-row tiles, else 4). Untuned defaults: time variants with bench/attention_kernels.py on the GPU."""
    _check_shapes(q, k_pages, v_pages, page_table, cu_seqlens, positions)
    T, H, _ = q.shape
    _, page_size, Hk, _ = k_pages.shape
    S, max_pages = page_table.shape
    if block_q is None:
        block_q = default_block_q(T, S, H, Hk)
    if num_splits is None:
        num_splits = default_num_splits(T, S, Hk, max_pages * page_size, block_q, block_k)
    if num_warps is None:
        num_warps = 8 if block_q * next_pow2(H // Hk) >= 128 else 4
    return _paged_attention_pallas(q, k_pages, v_pages, page_table, cu_seqlens, positions, scale=float(scale),
                                   block_q=int(block_q), block_k=int(block_k), num_splits=int(num_splits),
                                   num_warps=int(num_warps), num_stages=int(num_stages), interpret=interpret)


def pallas_problem(heads: int, kv_heads: int, head_dim: int, num_tokens: int = 1, num_seqs: int = 1,
                   block_q=None, block_k: int = DEFAULT_BLOCK_K) -> str | None:
    """Why the compiled kernel cannot take these shapes: tiles [BQ * Rp, d] x [BK, d] must be powers of two >= 16."""
    if block_q is None:
        block_q = default_block_q(num_tokens, num_seqs, heads, kv_heads)
    rows = block_q * next_pow2(heads // max(kv_heads, 1))
    return (pow2_tile_problem("head_dim", head_dim) or pow2_tile_problem("block_k", block_k)
            or pow2_tile_problem("query rows per block (block_q * padded heads per kv head)", rows))


def paged_attention(q, k_pages, v_pages, *, page_table, cu_seqlens, positions, scale: float, impl: str = "auto",
                    interpret: bool = False, **kernel_options):
    """See the module docstring. `kernel_options`: block_q, block_k, num_splits, num_warps, num_stages."""
    problem = pallas_problem(q.shape[1], k_pages.shape[2], q.shape[2], q.shape[0], cu_seqlens.shape[0] - 1,
                             kernel_options.get("block_q"), kernel_options.get("block_k", DEFAULT_BLOCK_K))
    if resolve_impl(impl, interpret, problem, "paged_attention") == "xla":
        return paged_attention_reference(q, k_pages, v_pages, page_table=page_table, cu_seqlens=cu_seqlens,
                                         positions=positions, scale=float(scale))
    return paged_attention_pallas(q, k_pages, v_pages, page_table=page_table, cu_seqlens=cu_seqlens,
                                  positions=positions, scale=scale, interpret=interpret, **kernel_options)
