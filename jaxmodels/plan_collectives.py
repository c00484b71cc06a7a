"""The collectives of a compiled step program, read from its HLO, and the time they take on a GPU cluster.

`collectives(hlo_text)` lists every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute of a
compiled (SPMD-partitioned: one device's) program with its result shape and its groups of devices, as mesh
positions (the order of `mesh.devices.flat`, which `sharding.make_mesh` takes from `jax.devices()`: one host's devices
after the other's). Collectives inside loops would run once per iteration; the step programs have none there.

`transfer_s` prices them with the ring algorithm NCCL uses, per device, for a result of R bytes over a group of n:
  * all-reduce:          2 (n-1)/n · R   (a reduce-scatter, then an all-gather)
  * all-gather:          (n-1)/n · R     (R is the gathered result; each device sends its R/n to the others)
  * reduce-scatter:      (n-1) · R       (the operand is n·R; each device receives n-1 partial blocks of R)
  * all-to-all:          (n-1)/n · R
  * collective-permute:  R
each over the bandwidth of the slowest link in the group: NVLink within a host of `devices_per_node` GPUs, the
InfiniBand NIC between hosts (each GPU with its own NIC, as on an H200 HGX node), plus a fixed latency per
collective. Time = Σ (latency + traffic / bandwidth); collectives are assumed not to overlap compute or each other.
"""

import dataclasses
import math
import re

import numpy as np

# Opcodes of collectives in optimized HLO; an async pair counts once, at its start (an async reduce-scatter wraps the
# plain instruction in a called computation, where it is found as it is).
OPCODES = {"all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "all-gather": "all-gather",
           "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
           "ragged-all-to-all": "all-to-all", "collective-permute": "collective-permute",
           "collective-permute-start": "collective-permute"}
# Async starts whose tuple type holds their operand(s) before their result(s).
OPERAND_FIRST = {"all-gather-start", "collective-permute-start"}
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Link:
    """Per-device bandwidth (bytes/s, one direction) and per-collective latency (s) of one kind of link."""

    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    devices_per_node: int
    nvlink: Link
    network: Link

    def link(self, groups: tuple[tuple[int, ...], ...]) -> Link:
        """The link a collective over `groups` is limited by: the network if any group spans two hosts."""
        crosses = any(len({device // self.devices_per_node for device in group}) > 1 for group in groups)
        return self.network if crosses else self.nvlink


# H200 HGX: NVLink 4 at 450 GB/s per direction per GPU; one 400 Gb/s InfiniBand NIC per GPU between hosts. The
# latencies are assumptions of the order NCCL reaches for small messages (tens of microseconds across hosts).
H200_CLUSTER = Cluster(devices_per_node=8, nvlink=Link(450e9, 10e-6), network=Link(400e9 / 8, 20e-6))


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of the values of OPCODES
    dtype: str
    result_bytes: int  # on each device
    groups: tuple[tuple[int, ...], ...]  # mesh positions of each group (one group: all of them)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def operand_bytes(self) -> int:
        """Bytes each device contributes."""
        n = self.group_size
        if self.kind == "all-gather":
            return self.result_bytes // n
        if self.kind == "reduce-scatter":
            return self.result_bytes * n
        return self.result_bytes

    def traffic_bytes(self) -> float:
        """Bytes each device sends (and receives) under the ring algorithm (module docstring)."""
        n, r = self.group_size, self.result_bytes
        if self.kind == "collective-permute":
            return r
        if n == 1:
            return 0.0
        return {"all-reduce": 2 * (n - 1) / n * r, "all-gather": (n - 1) / n * r,
                "reduce-scatter": (n - 1) * r, "all-to-all": (n - 1) / n * r}[self.kind]

    def seconds(self, cluster: Cluster, bytes_scale: float = 1.0) -> float:
        """Latency plus the ring's traffic (times `bytes_scale`) over the group's slowest link."""
        link = cluster.link(self.groups)
        return link.latency + bytes_scale * self.traffic_bytes() / link.bandwidth

    def describe_groups(self) -> str:
        """"8 groups of 1", "1 group of 8 [0..7]" ...: how many groups and their size, the first group's members."""
        first = self.groups[0] if self.groups else ()
        members = f"{first[0]}..{first[-1]}" if list(first) == list(range(first[0], first[-1] + 1)) else \
            ",".join(map(str, first))
        return f"{len(self.groups)} x {len(first)} [{members}]"


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """The collectives of an optimized HLO module's text (every computation's), in program order."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        rest = match.group("rest")
        opcode = _OPCODE.search(rest)
        if not opcode or opcode.group(1) not in OPCODES:
            continue
        kind = OPCODES[opcode.group(1)]
        arrays = _ARRAY.findall(rest[:opcode.start()])
        if opcode.group(1) in OPERAND_FIRST:
            arrays = arrays[len(arrays) // 2:] if opcode.group(1) == "all-gather-start" else arrays[1:2]
        arrays = [(dtype, dims) for dtype, dims in arrays if dtype in DTYPE_BYTES]
        result = sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dtype] for dtype, dims in arrays)
        groups = (_pairs(rest) if kind == "collective-permute" else _replica_groups(rest, num_devices))
        found.append(Collective(kind=kind, dtype=arrays[0][0] if arrays else "?", result_bytes=result,
                                groups=groups))
    return found


def _pairs(rest: str) -> tuple[tuple[int, ...], ...]:
    """A collective-permute's (source, target) pairs."""
    return _explicit_groups(rest.split("source_target_pairs=", 1)[1]) if "source_target_pairs=" in rest else ()


def _explicit_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """{{0,1},{2,3}} at the start of `text` -> ((0, 1), (2, 3))."""
    body = re.match(r"\{((?:\{[\d,]*\},?)*)\}", text).group(1)
    return tuple(tuple(int(x) for x in group.split(",") if x) for group in re.findall(r"\{([\d,]*)\}", body))


def _replica_groups(rest: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The groups of a collective's `replica_groups`, in any of the three forms XLA prints: explicit lists, an iota
    ([G,S]<=[dims]T(perm)) or mesh axes (mesh['a'=2,'b'=4] {'b'}); none given means one group of every device."""
    if "replica_groups=" not in rest:
        return (tuple(range(num_devices)),)
    text = rest.split("replica_groups=", 1)[1]
    if text.startswith("{}"):
        return (tuple(range(num_devices)),)
    if text.startswith("{"):
        return _explicit_groups(text)
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in iota.group(2).split(","))).reshape(
            [int(x) for x in iota.group(2).split(",")])
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(shape[0], -1))
    mesh = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    if mesh:
        axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        varying = set(re.findall(r"'([^']+)'", mesh.group(2)))
        ids = np.arange(math.prod(size for _, size in axes)).reshape([size for _, size in axes])
        order = [i for i, (name, _) in enumerate(axes) if name not in varying] + \
                [i for i, (name, _) in enumerate(axes) if name in varying]
        group_size = math.prod(size for name, size in axes if name in varying)
        return tuple(tuple(int(x) for x in row) for row in ids.transpose(order).reshape(-1, group_size))
    raise ValueError(f"replica_groups in a form this parser does not know: {text[:120]!r}")


def summary(found: list[Collective]) -> list[dict]:
    """The collectives grouped by kind, dtype, size and groups, with their counts, in order of first appearance."""
    rows: dict[tuple, dict] = {}
    for c in found:
        key = (c.kind, c.dtype, c.result_bytes, c.groups)
        row = rows.setdefault(key, dict(kind=c.kind, dtype=c.dtype, operand_bytes=c.operand_bytes,
                                        result_bytes=c.result_bytes, groups=c.describe_groups(), count=0,
                                        collective=c))
        row["count"] += 1
    return list(rows.values())
