"""Where the Mosaic sparse MLA decode kernel's time goes, by taking parts out (issue 42): the whole kernel (its default
schedule, `SCHEDULE = "auto"`), the owner schedule whole, and then the owner schedule's compute alone (the producer
gathers nothing, so each block is published at once and the warpgroups compute on whatever the slots hold), its gathers
unwaited for (each block published while its rows are in flight: their traffic without their latency) and its gathers
alone (no wgmma: S is zeros and P V adds nothing; the softmax and P's stores stay). If the whole kernel takes about as
long as one part, that part sets the pace; if it takes about their sum, the two do not overlap. Then the whole kernel
with warpgroup 0's share of the value columns cut (it also computes S and the softmax, so its chain is the longer one;
warpgroup 1 takes the rest): 256 (the kernel's), 192 and 128 columns, each with the registers that leave ptxas no spills
(`tools/aot_h200.py`). Last the seesaw schedule (`_seesaw_schedule`: each warpgroup computes S for every other block,
and the copies arrive on their half slots' barriers themselves), whole and its compute alone, then with warpgroup 0's S
issued at the top of each pair instead of behind its last P V (`SEESAW_EARLY_S`); and the owner schedule with FlashMLA's
L2 hints on the gather's copies (`GATHER_L2_HINTS`; the kernel refuses them on the seesaw). Each variant that computes
the whole product gives its RMS difference from the kernel's output. B = 32 / 128 queries by default, top-2048, 128
heads, dsa_kernels' timing.

    PYTHONPATH=. python bench/lab/mla_mosaic_split.py        # bash bench/lab/h200_runs.sh mla_split
    PYTHONPATH=. python bench/lab/mla_mosaic_split.py --batches 128 --only "seesaw;seesaw compute"   # a short call
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "bench")
from dsa_kernels import sets_for, timed  # noqa: E402
from jaxmodels.benchmark_floors import COPY_BANDWIDTH  # noqa: E402
import pallas_kernels.sparse_mla_mosaic as mla  # noqa: E402
from tests.numerics import rms_relative_error  # noqa: E402

KERNEL_OPS = mla._Compiled
# Warpgroup 0's value columns, with its registers and warpgroup 1's: ptxas reports no spills for these (28 bytes for
# the kernel's 256 at 256 / 200).
COLUMN_SPLITS = [(192, 240, 224), (128, 216, 256)]


class ComputeOnly(KERNEL_OPS):
    """No rows copied: `wait_for_gathers` finds nothing in flight, and each block is published at once."""

    def gather(self, cache_gmem, indices_gmem, start, keys, rows_ref, index_ref, columns=None):
        del cache_gmem, indices_gmem, start, keys, rows_ref, index_ref, columns


class GathersUnwaited(KERNEL_OPS):
    """The rows copied but never waited for: each block is published at once, while its copies are in flight (the
    output is wrong). Beside the whole kernel and its compute alone, it tells the gathers' traffic (the copies'
    writes to shared memory beside wgmma's reads, DRAM) from their latency: as slow as the whole kernel, the traffic
    costs; as fast as the compute alone, the wait for the rows does."""

    def wait_for_gathers(self, pending: int):
        del pending


class GathersOnly(KERNEL_OPS):
    """No tensor-core work: S is zeros and P V leaves the accumulator as it is."""

    def matmul_transposed(self, a_ref, b_ref):
        return self.with_layout(jnp.zeros((a_ref.shape[0], b_ref.shape[0]), jnp.float32), self.plgpu.Layout.WGMMA)

    def accumulate(self, acc, a, b_ref):
        del a, b_ref
        return acc


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,128", help="queries a call, comma-separated")
    parser.add_argument("--only", help="the variants to time besides the whole kernel (the baseline and the reference "
                        "of the RMS differences), by name, ';' between (default: all)")
    args = parser.parse_args()
    H, k, rows = 128, 2048, 1 << 18
    cache = jax.random.normal(jax.random.key(6), (rows, 576)).astype(jnp.bfloat16)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; top-{k}, {H} heads")
    for B in map(int, args.batches.split(",")):
        bytes_ = B * k * 576 * 2 + B * H * 576 * 2 + B * H * 512 * 2 + B * k * 4
        floor = bytes_ / COPY_BANDWIDTH
        problems = [(jax.random.normal(jax.random.key(B + 2 * i), (B, H, 576)).astype(jnp.bfloat16),
                     jax.random.randint(jax.random.key(B + 2 * i + 1), (B, k), 0, rows).astype(jnp.int32))
                    for i in range(sets_for(floor, bytes_))]
        n = jnp.full((B,), k, jnp.int32)
        owner = dict(SCHEDULE="owner")
        variants = [("whole kernel", KERNEL_OPS, {}), ("owner", KERNEL_OPS, owner),
                    ("compute only", ComputeOnly, owner),
                    ("gathers unwaited", GathersUnwaited, owner), ("gathers only", GathersOnly, owner)] + [
            (f"wg0 {columns} columns", KERNEL_OPS,
             dict(owner, OWNER_COLUMNS=columns, OWNER_REGISTERS=registers, SECOND_REGISTERS=second))
            for columns, registers, second in COLUMN_SPLITS] + [
            ("seesaw", KERNEL_OPS, dict(SCHEDULE="seesaw")), ("seesaw compute", ComputeOnly, dict(SCHEDULE="seesaw")),
            ("seesaw, S at top", KERNEL_OPS, dict(SCHEDULE="seesaw", SEESAW_EARLY_S=False)),
            ("L2 hints", KERNEL_OPS, dict(owner, GATHER_L2_HINTS=True))]
        if args.only:
            wanted = args.only.split(";")
            unknown = set(wanted) - {name for name, _, _ in variants}
            if unknown:
                parser.error(f"no variants named {sorted(unknown)}")
            variants = [variant for variant in variants if variant[0] in wanted or variant[0] == "whole kernel"]
        for name, ops, constants in variants:
            kept = {constant: getattr(mla, constant) for constant in constants}
            mla._Compiled = ops
            for constant, value in constants.items():
                setattr(mla, constant, value)
            try:
                seconds = timed(lambda c, q, i: mla.sparse_mla_decode_mosaic(q, c, i, scale=0.04, listed=n),
                                (cache,), problems)
                out = mla.sparse_mla_decode_mosaic(problems[0][0], cache, problems[0][1], scale=0.04, listed=n)
            finally:
                mla._Compiled = KERNEL_OPS
                for constant, value in kept.items():
                    setattr(mla, constant, value)
            if ops is KERNEL_OPS and not constants:
                reference = out.astype(jnp.float32)
            differs = "" if ops is not KERNEL_OPS else f"  rms difference {rms_relative_error(out, reference):.1e}"
            print(f"B={B:<4} {name:<16} {seconds * 1e3:.4f} ms  ({100 * floor / seconds:.1f}% of the byte floor)"
                  f"{differs}", flush=True)


if __name__ == "__main__":
    main()
