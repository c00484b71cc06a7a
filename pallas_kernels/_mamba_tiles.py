"""What the two Mamba2 Triton kernels (the SSD scan and the decode state update) share inside their bodies: the
[P, N] state tile of one (head, head-dim block) program, and a softplus that Triton lowers."""

import jax.numpy as jnp
from jax import lax


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
