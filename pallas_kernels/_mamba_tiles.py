"""What the Mamba2 Triton kernels (the SSD scan and the decode state update) share: how a head dim is cut into tiles,
the [P, N] state tile of one (head, head-dim block) program, and a softplus that Triton lowers."""

import jax.numpy as jnp
from jax import lax

from pallas_kernels._dispatch import next_pow2


def head_dim_tiles(P: int, block_p: int, *, narrow_last: bool) -> tuple[int, int, int]:
    """(BP, npb, BP_last): a head's P rows as npb tiles of BP rows, the last one BP_last wide (<= BP).

    Triton's tiles are powers of two >= 16, so P = 80 in 64-wide tiles pads its second tile to 64 rows of which 16 are
    real. With `narrow_last` that tile is only as wide as the power of two that covers the rest (80 = 64 + 16): its
    programs do a quarter of the head-dim products (C Bᵀ is the same), and the GPU runs them beside wide ones.
    """
    BP = max(min(next_pow2(P), block_p), 16)
    npb = -(-P // BP)
    BP_last = max(next_pow2(P - (npb - 1) * BP), 16) if narrow_last else BP
    return BP, npb, BP_last


def head_tile(pid, *, npb: int, BP: int, BN: int, P: int, N: int, R: int):
    """Program `pid` of the (head, head-dim block) grid axis, with `npb` blocks of BP rows per head and R heads per
    group -> (h, g, p0, pmask, nmask, pn_mask): head, its B/C group, first head-dim row, and the masks of the real
    rows [BP], real state columns [BN] (N padded up to BN) and both [BP, BN]."""
    h = pid // npb
    p0 = (pid % npb) * BP
    return (h, h // R, p0, *tile_masks(p0, BP=BP, BN=BN, P=P, N=N))


def tile_masks(p0, *, BP: int, BN: int, P: int, N: int):
    """(pmask, nmask, pn_mask) of the [BP, BN] state tile whose first head-dim row is p0: the real rows [BP], the
    real state columns [BN] (N padded up to BN) and both [BP, BN]."""
    pmask = (p0 + lax.broadcasted_iota(jnp.int32, (BP,), 0)) < P
    nmask = lax.broadcasted_iota(jnp.int32, (BN,), 0) < N
    return pmask, nmask, pmask[:, None] & nmask[None, :]


def softplus(v):
    # Stable form that lowers to exp/log1p in Triton: max(v, 0) + log1p(exp(-|v|)).
    return jnp.maximum(v, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(v)))
