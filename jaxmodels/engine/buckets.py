"""Padded batch shapes. Each bucket is one compiled executable (our CUDA graph); a batch pads up to the next one
that is compiled (engine.warmup compiles the largest first, the others in the background)."""

import bisect

# Sizes per doubling of the default lists: 2 gives 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (each a power of two or 1.5
# times one). Measured on the H200 (bench/startup.py padding, Nano-30B class; docs/BENCHMARKS.md "Start-up"): a batch
# padded to its bucket costs 6.6% more on average at decode and 4.8% at prefill, against 1.6% / 1.3% with the old
# SGLang-like lists of 38 + 38 buckets; these have 16 + 13, each seconds of lowering in the background compilation.
STEPS_PER_OCTAVE = 2
SMALLEST_PREFILL = 16


def geometric(first: int, largest: int, per_octave: int) -> list[int]:
    """Sizes from `first` up to (and always including) `largest`: each power of two times 1, 1 + 1/p, 1 + 2/p, ...
    (p = per_octave), the integral ones."""
    sizes, power = set(), 1
    while power <= largest:
        sizes |= {power * (per_octave + i) // per_octave for i in range(per_octave)
                  if power * (per_octave + i) % per_octave == 0}
        power *= 2
    return _capped([s for s in sizes if s >= first], largest)


def decode_buckets(max_batch_size: int, per_octave: int = STEPS_PER_OCTAVE) -> list[int]:
    """Decode batch sizes: 1 up to max_batch_size, `per_octave` per doubling."""
    return geometric(1, max_batch_size, per_octave)


def prefill_buckets(max_tokens: int, per_octave: int = STEPS_PER_OCTAVE) -> list[int]:
    """Prefill token counts: SMALLEST_PREFILL up to max_tokens, `per_octave` per doubling."""
    return geometric(min(SMALLEST_PREFILL, max_tokens), max_tokens, per_octave)


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
