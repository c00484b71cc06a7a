"""Cache pools and their host-side allocators.

Device side, each model declares its caches, one per layer (`model.cache_shapes`: paged KV / latent / index-key
pages, Mamba state slots); here they are sized and allocated. Page 0 and slot 0 are the null page / slot: padded
tokens and requests read and write only them, and the allocators never hand them to a real request.
"""

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

log = logging.getLogger("jaxmodels.engine")


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    page_size: int
    num_pages: int  # including the null page 0
    num_slots: int  # including the null slot 0
    pages_per_seq: int  # width of a page-table row
    num_snapshots: int = 0  # recurrent-state slots after the request slots, kept by the prefix cache

    @property
    def state_slots(self) -> int:
        """Rows of a recurrent-state pool: the request slots (null slot included), then the snapshots."""
        return self.num_slots + self.num_snapshots

    @classmethod
    def from_limits(cls, *, max_batch_size: int, max_seq_len: int, page_size: int = 16,
                    num_pages: int | None = None, num_snapshots: int = 0) -> "PoolSizes":
        pages_per_seq = math.ceil(max_seq_len / page_size)
        if num_pages is None:
            num_pages = 1 + max_batch_size * pages_per_seq
        if num_pages - 1 < pages_per_seq:
            # Below this a single max-length request could never finish, preemption or not.
            raise ValueError(f"num_pages={num_pages} cannot hold one request of max_seq_len={max_seq_len} "
                             f"({pages_per_seq} pages of {page_size} plus the null page)")
        return cls(page_size=page_size, num_pages=num_pages, num_slots=max_batch_size + 1,
                   pages_per_seq=pages_per_seq, num_snapshots=num_snapshots)


def allocate_caches(shapes, shardings=None) -> dict:
    """Zero-filled device arrays for a pytree of ShapeDtypeStructs, with the total size logged.

    With `shardings` (the same pytree of NamedShardings) each array is created in place, shard by shard.
    """
    if shardings is None:
        caches = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    else:
        caches = jax.tree.map(
            lambda s, sharding: jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=sharding)(),
            shapes, shardings)
    total = total_bytes(shapes)
    log.info("cache pools: %s, %.1f MiB in all", describe(shapes), total / 2**20)
    return caches


def total_bytes(shapes) -> int:
    return sum(s.size * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))


def pages_within(budget_bytes: int, cache_shapes, sizes: PoolSizes) -> int:
    """How many pages (null page included) fit in `budget_bytes` beside the slot pools, for a step whose
    `cache_shapes(sizes)` grows linearly with `sizes.num_pages`."""
    one = total_bytes(cache_shapes(dataclasses.replace(sizes, num_pages=1)))
    per_page = total_bytes(cache_shapes(dataclasses.replace(sizes, num_pages=2))) - one
    fixed = one - per_page  # slot pools (Mamba state) and anything else not paged
    pages = (budget_bytes - fixed) // per_page if per_page else sizes.num_pages
    if pages - 1 < sizes.pages_per_seq:
        raise ValueError(f"a cache budget of {budget_bytes / 2**20:.1f} MiB holds {max(pages, 0)} pages of "
                         f"{per_page / 2**10:.1f} KiB beside {fixed / 2**20:.1f} MiB of state slots: not enough for "
                         f"one request of {sizes.pages_per_seq} pages; lower max_seq_len, max_batch_size or "
                         "mamba_cache_slots (prefix caching's state snapshots), or raise memory_fraction")
    return int(pages)


def _addressable(devices):
    """This process's devices among `devices` (all of its own by default): only those report their memory."""
    return [d for d in devices if d.process_index == jax.process_index()] if devices else jax.local_devices()


def reports_memory(devices=None) -> bool:
    """Whether this process's devices tell how much memory they have (GPUs do, CPUs do not)."""
    return all("bytes_limit" in (device.memory_stats() or {}) for device in _addressable(devices))


def free_device_memory(devices=None) -> int:
    """Bytes the allocator can still hand out on the most used device (the one that runs out first)."""
    free = []
    for device in _addressable(devices):
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"{device.platform} devices do not report their memory: memory_fraction needs a GPU; "
                             "size the pools with max_batch_size / max_seq_len or num_pages instead")
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


def cache_arrays(shapes):
    """(layer's cache, field name, array) of each array of per-layer caches (None for a layer without one)."""
    for layer in shapes:
        if layer is None:
            continue
        for field in dataclasses.fields(layer):
            value = getattr(layer, field.name)
            if value is not None:
                yield layer, field.name, value


def describe(shapes) -> str:
    """`shapes`: per layer, a cache dataclass of ShapeDtypeStructs (or None) -> "k 4 x (...) bfloat16; ..."."""
    fields: dict[str, list] = {}
    for _, name, value in cache_arrays(shapes):
        fields.setdefault(name, []).append(value)
    return "; ".join(f"{name} {len(arrays)} x {tuple(arrays[0].shape)} {jnp.dtype(arrays[0].dtype).name}"
                     for name, arrays in fields.items())


class FreeList:
    """Ids 1..count-1 (0 is the null id, never handed out)."""

    def __init__(self, count: int, what: str):
        self.what = what
        self._free = list(range(count - 1, 0, -1))  # pop() hands out low ids first

    def __len__(self) -> int:
        return len(self._free)

    def take(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} {self.what}s with {len(self._free)} free")
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def give_back(self, ids) -> None:
        for i in ids:
            if i <= 0:
                raise RuntimeError(f"null {self.what} 0 given back")
            self._free.append(i)
