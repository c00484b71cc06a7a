"""Padded batch shapes. Each bucket is one compiled executable (our CUDA graph); a batch pads up to the next one."""

import bisect


def decode_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 4 to 32, then steps of 8, capped at (and always including) max_batch_size."""
    sizes = [1, 2, 4, 8, *range(12, 33, 4)]
    size = 40
    while size < max_batch_size:
        sizes.append(size)
        size += 8
    return _capped(sizes, max_batch_size)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts of SGLang's piecewise list: 4-32 by 4, 48-256 by 16, 288-512 by 32, 576-1024 by 64, then by 256
    to 4096 and by 512 beyond, capped at (and always including) max_tokens."""
    sizes = [*range(4, 33, 4), *range(48, 257, 16), *range(288, 513, 32), *range(576, 1025, 64),
             *range(1280, 4097, 256)]
    size = 4608
    while size < max_tokens:
        sizes.append(size)
        size += 512
    return _capped(sizes, max_tokens)


def _capped(sizes: list[int], cap: int) -> list[int]:
    if cap < 1:
        raise ValueError(f"bucket cap must be >= 1, got {cap}")
    return sorted({s for s in sizes if s < cap} | {cap})


def bucket_for(buckets: list[int], n: int) -> int:
    """Smallest bucket holding n items."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
