"""The Mosaic GPU sparse MLA decode kernel (`pallas_kernels.sparse_mla_mosaic`): its lowering for an H200 (any
machine, jax 0.10 included), its split of the lists and the shapes it refuses (anywhere), and its output against
dense attention masked to the same rows, compiled on the GPU and in Mosaic GPU's interpreter on CPU (there with
plain copies and dots in place of its cp.async gather and wgmma, which the interpreter does not run)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_mla_attention
from pallas_kernels.sparse_mla_mosaic import (BLOCK_KEYS, decode_splits, mosaic_problem, schedule_for,
                                              sparse_mla_decode_mosaic)
from tests.cpu_devices import run_on_devices
from tests.mosaic_interpreter import run_race_checked, stopped_if_hung
from tests.mosaic_marks import needs_mosaic, needs_mosaic_lowering
from tests.numerics import rms_relative_error
from tests.pallas_kernels.test_sparse_mla_attention import _problem, dense_masked_attention

# The seesaw schedule's switches by name: by default, and with warpgroup 0's S issued at the top of each pair.
SEESAW_SETTINGS = {"defaults": dict(EARLY_S=True), "s_at_top": dict(EARLY_S=False)}


def set_seesaw(settings: str, setter=setattr):
    """The kernel on the seesaw schedule with `settings` (`SEESAW_SETTINGS`), each constant set by `setter`
    (`monkeypatch.setattr` in a test; `setattr` in a process of its own)."""
    sparse_mla_mosaic = importlib.import_module("pallas_kernels.sparse_mla_mosaic")
    setter(sparse_mla_mosaic, "SCHEDULE", "seesaw")
    for switch, value in SEESAW_SETTINGS[settings].items():
        setter(sparse_mla_mosaic, f"SEESAW_{switch}", value)


@pytest.fixture(autouse=True)
def owner_schedule_unless_set(monkeypatch):
    """The tests here name their schedule: the owner schedule unless a test sets the seesaw (`set_seesaw`), so that
    each schedule is tested on every shape, whichever `auto` would pick for it."""
    monkeypatch.setattr(importlib.import_module("pallas_kernels.sparse_mla_mosaic"), "SCHEDULE", "owner")


# The interpreter's runs are the CPU's check; on the GPU the compiled kernel's tests take their place.
on_cpu = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the compiled kernel is tested on the GPU")


@needs_mosaic_lowering
@pytest.mark.parametrize("T, H, listed, splits", [(128, 128, False, None), (1, 128, True, None), (5, 64, True, 3),
                                                  (32, 128, False, 1)])
def test_kernel_lowers_for_the_h200(T, H, listed, splits):
    """Mosaic GPU's lowering (the warpgroups' barriers, the wgmma operands' layouts, the inline cp.async gather, and
    shared memory within the H200's 227 KiB), without a GPU: one program a query's head block (B=128), the list
    split over programs (B=1, 5), and one program walking a whole 2048-key list."""
    S = jax.ShapeDtypeStruct
    args = [S((T, H, 576), jnp.bfloat16), S((1 << 18, 576), jnp.bfloat16), S((T, 2048), jnp.int32)]
    if listed:
        f = jax.jit(lambda q, c, i, n: sparse_mla_decode_mosaic(q, c, i, scale=0.04, listed=n, num_splits=splits))
        args.append(S((T,), jnp.int32))
    else:
        f = jax.jit(lambda q, c, i: sparse_mla_decode_mosaic(q, c, i, scale=0.04, num_splits=splits))
    jax.export.export(f, platforms=["cuda"])(*args)


@needs_mosaic_lowering
@pytest.mark.parametrize("seesaw, hints", [("defaults", False), ("s_at_top", False), (None, True)])
@pytest.mark.parametrize("T, listed", [(128, False), (1, True)])
def test_schedules_and_gather_hints_lower_for_the_h200(seesaw, hints, T, listed, monkeypatch):
    """The seesaw schedule's lowering (shared memory within the H200's 227 KiB with Pallas' reduction scratch off)
    with each setting of its switches (`SEESAW_SETTINGS`), and the gather's L2 hints (None: the owner schedule), one
    program a query's head block and a list split over programs."""
    monkeypatch.setattr(importlib.import_module("pallas_kernels.sparse_mla_mosaic"), "GATHER_L2_HINTS", hints)
    if seesaw:
        set_seesaw(seesaw, monkeypatch.setattr)
    test_kernel_lowers_for_the_h200(T, 128, listed, None)


def test_gather_hints_on_the_seesaw_are_refused(monkeypatch):
    """The seesaw with the L2 hints stopped the GPU on an illegal instruction (H100 and H200): refused, not run."""
    sparse_mla_mosaic = importlib.import_module("pallas_kernels.sparse_mla_mosaic")
    monkeypatch.setattr(sparse_mla_mosaic, "GATHER_L2_HINTS", True)
    set_seesaw("defaults", monkeypatch.setattr)
    S = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="GATHER_L2_HINTS with the seesaw"):
        jax.eval_shape(lambda q, c, i: sparse_mla_decode_mosaic(q, c, i, scale=0.04),
                       S((128, 128, 576), jnp.bfloat16), S((1 << 18, 576), jnp.bfloat16), S((128, 2048), jnp.int32))


def test_lists_split_to_fill_whole_waves_of_programs(monkeypatch):
    """On 132 SMs (one program each) at 128 heads, top-2048 (32 blocks): B=128 gives 256 programs unsplit; B=32
    splits in two (one wave of 128 programs, 16 blocks each; three splits would be two waves of 11); B=1 splits as
    far as 4 blocks a program allows; a list of fewer than 8 blocks is not split."""
    sparse_mla_mosaic = importlib.import_module("pallas_kernels.sparse_mla_mosaic")
    monkeypatch.setattr(sparse_mla_mosaic, "num_sms", lambda: 132)
    assert decode_splits(128, heads=128, topk=2048) == 1
    assert decode_splits(32, heads=128, topk=2048) == 2
    assert decode_splits(1, heads=128, topk=2048) == 2048 // (4 * BLOCK_KEYS)
    assert decode_splits(1, heads=128, topk=7 * BLOCK_KEYS) == 1
    assert decode_splits(48, heads=128, topk=2048) == 4  # 96 programs a split: 2 -> 2 waves of 16, 4 -> 3 of 8


def test_auto_takes_the_seesaw_for_programs_of_32_blocks_or_more(monkeypatch):
    """B=128 at top-2048 walks 32 blocks a program (the seesaw), B=32 two splits of 16 (the owner schedule); a name
    that is no schedule is refused."""
    sparse_mla_mosaic = importlib.import_module("pallas_kernels.sparse_mla_mosaic")
    monkeypatch.setattr(sparse_mla_mosaic, "SCHEDULE", "auto")
    assert schedule_for(2048, splits=1) == "seesaw"
    assert schedule_for(2048, splits=2) == "owner"
    assert schedule_for(2047, splits=1) == "seesaw"  # 31 blocks and a part: 32 walked
    assert schedule_for(31 * BLOCK_KEYS, splits=1) == "owner"
    for schedule in ("owner", "seesaw"):
        monkeypatch.setattr(sparse_mla_mosaic, "SCHEDULE", schedule)
        assert schedule_for(2048, splits=1) == schedule_for(2048, splits=2) == schedule
    monkeypatch.setattr(sparse_mla_mosaic, "SCHEDULE", "Seesaw")
    with pytest.raises(ValueError, match="not owner, seesaw or auto"):
        schedule_for(2048, splits=1)


def test_shapes_the_kernel_does_not_take_are_named():
    assert mosaic_problem(128, 576, 512, jnp.bfloat16, jnp.bfloat16) is None
    assert "heads=96" in mosaic_problem(96, 576, 512, jnp.bfloat16, jnp.bfloat16)
    assert "576" in mosaic_problem(128, 320, 256, jnp.bfloat16, jnp.bfloat16)
    assert "float32" in mosaic_problem(128, 576, 512, jnp.float32, jnp.bfloat16)
    assert "float8" in mosaic_problem(128, 576, 512, jnp.bfloat16, jnp.float8_e4m3fn)


def test_asking_for_the_mosaic_kernel_where_it_cannot_run_says_why():
    q, cache, idx = _problem(jax.random.key(0), T=4, H=64, dl=512, dr=64, num_pages=2, page_size=64, topk=64)
    q, cache = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU"):
            sparse_mla_attention(q, cache, idx, scale=0.04, impl="mosaic")
    with pytest.raises(ValueError, match="heads=32"):
        sparse_mla_attention(q[:, :32], cache, idx, scale=0.04, impl="mosaic")


def _bf16_problem(seed, T, H, topk, num_pages=64):
    q, cache, idx = _problem(jax.random.key(seed), T=T, H=H, dl=512, dr=64, num_pages=num_pages, page_size=64,
                             topk=topk)
    return q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16), idx


def check_against_dense_attention(run, T, H, topk, num_pages=64):
    """`run(q, cache, idx)` of `_problem`'s lists (a full list, 5 keys then −1, only −1, holes) against dense
    attention masked to the same rows."""
    q, cache, idx = _bf16_problem(2, T=T, H=H, topk=topk, num_pages=num_pages)
    want = dense_masked_attention(q.astype(jnp.float32), cache.astype(jnp.float32), idx, 0.04, 512)
    got = run(q, cache, idx)
    assert got.dtype == jnp.bfloat16
    # P is rounded to bf16 before P @ V on the tensor cores: bf16-level error, as for the Triton kernel.
    assert rms_relative_error(got, want) < 2e-2
    assert not np.asarray(got[2], np.float32).any()


def check_listed_counts(run, T, topk, counts):
    """`run(q, cache, idx, listed)` with `listed` counts per query (`counts` first, random after), where the
    entries past the counts are stale rows the kernel must not read as keys (64 heads)."""
    q, cache, idx = _bf16_problem(3, T=T, H=64, topk=topk)
    listed = np.random.default_rng(0).integers(0, topk + 1, T)
    listed[:len(counts)] = counts
    fresh = np.where(np.arange(topk)[None] < listed[:, None], np.asarray(idx), -1)
    want = dense_masked_attention(q.astype(jnp.float32), cache.astype(jnp.float32), fresh, 0.04, 512)
    got = run(q, cache, jnp.asarray(np.asarray(idx)), jnp.asarray(listed, jnp.int32))
    assert rms_relative_error(got, want) < 2e-2
    assert not np.asarray(got[listed == 0], np.float32).any()


@needs_mosaic
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_compiled_kernel_equals_dense_masked_attention(splits):
    """128 heads, top-2048 over 4,096 rows, split over 8 programs each (the default at T=4), or one program walking
    the 32 blocks of each list through the two row slots."""
    check_against_dense_attention(
        jax.jit(lambda *a: sparse_mla_attention(*a, scale=0.04, impl="mosaic", num_splits=splits)),
        T=4, H=128, topk=2048)


@needs_mosaic
@pytest.mark.gpu
def test_compiled_kernel_walks_only_the_listed_blocks():
    """A partial last block, a single key, none, all; top-k of 200 (padded to whole blocks with −1); 130 queries
    (more programs than SMs)."""
    check_listed_counts(jax.jit(lambda q, c, i, n: sparse_mla_attention(q, c, i, scale=0.04, listed=n,
                                                                         impl="mosaic")),
                        T=130, topk=200, counts=[200, 1, 0, 65])


@needs_mosaic
@pytest.mark.gpu
@pytest.mark.parametrize("seesaw", ["defaults", "s_at_top"])
@pytest.mark.parametrize("splits", [None, 1])
def test_compiled_seesaw_schedule_equals_dense_masked_attention(splits, seesaw, monkeypatch):
    """The seesaw schedule compiled (its half slots' copies arriving on their barriers), as by default and with
    warpgroup 0's S at the top of each pair: the cases of the two tests above (a new schedule's barriers could
    deadlock on the GPU: the worker stops after 240 s rather than hold the suite)."""
    set_seesaw(seesaw, monkeypatch.setattr)
    with stopped_if_hung(240):
        test_compiled_kernel_equals_dense_masked_attention(splits)
        test_compiled_kernel_walks_only_the_listed_blocks()


def interpreted(q, cache, idx, listed=None, *, num_splits):
    """The kernel in Mosaic GPU's interpreter with its race detector on (`run_race_checked`), through
    `sparse_mla_attention` as the model calls it."""
    return run_race_checked(sparse_mla_attention, q, cache, idx, scale=0.04, listed=listed, impl="mosaic",
                            num_splits=num_splits)


@needs_mosaic_lowering
@on_cpu
@pytest.mark.parametrize("splits", [2, 1])
def test_interpreted_kernel_equals_dense_masked_attention(splits):
    """The warpgroups, barriers, slots and softmax as the GPU runs them (`sparse_mla_mosaic._Interpreted`): 128
    heads (two programs a query), top-320 (5 blocks: both slots refilled, an odd last one), split in two (3 blocks
    and 2, combined by their log-sum-exp) or walked whole."""
    check_against_dense_attention(lambda q, c, i: interpreted(q, c, i, num_splits=splits), T=4, H=128, topk=320,
                                  num_pages=8)


@needs_mosaic_lowering
@on_cpu
def test_interpreted_kernel_with_a_smaller_share_for_the_softmax_owner(monkeypatch):
    """Warpgroup 0 on the first 192 value columns, warpgroup 1 on the other 320 in two wgmma pieces (256 and 64):
    the split `bench/lab/mla_mosaic_split.py` times against the kernel's 256 / 256."""
    sparse_mla_mosaic = importlib.import_module("pallas_kernels.sparse_mla_mosaic")
    monkeypatch.setattr(sparse_mla_mosaic, "OWNER_COLUMNS", 192)
    assert sparse_mla_mosaic.second_pieces() == [(192, 256), (448, 64)]
    check_against_dense_attention(lambda q, c, i: interpreted(q, c, i, num_splits=2), T=4, H=128, topk=320,
                                  num_pages=8)


@needs_mosaic_lowering
@on_cpu
@pytest.mark.parametrize("lists, seesaw", [("dense", "defaults"), ("listed", "defaults"), ("listed", "s_at_top")])
def test_interpreted_seesaw_schedule_equals_dense_masked_attention(lists, seesaw):
    """The seesaw schedule (`_seesaw_schedule`: warpgroups owning alternate blocks, the pair's row maximum passed
    between them, half slots published and freed on their own) as the GPU runs it: top-320 split in two (two pairs,
    and one block walked with an empty one), and the listed counts of the owner schedule's test below (a split with
    no keys walks a pair of none). As by default (warpgroup 0's next S issued behind its last P V) and with that S at
    the top of each pair (`SEESAW_SETTINGS`). In a subprocess of 4 simulated devices: see
    tests/pallas_kernels/seesaw_interpreted_check.py."""
    assert "equals dense masked attention" in run_on_devices("tests.pallas_kernels.seesaw_interpreted_check", lists,
                                                             seesaw, devices=4)


@needs_mosaic_lowering
@on_cpu
def test_interpreted_kernel_walks_only_the_listed_blocks():
    """Counts of a whole list, one key, none (no block walked: zeros), one key past a block, a block exactly,
    and two blocks and a bit, over lists of 200 split in two."""
    check_listed_counts(lambda q, c, i, n: interpreted(q, c, i, n, num_splits=2), T=6, topk=200,
                        counts=[200, 1, 0, 65, 64, 130])


@needs_mosaic_lowering
@pytest.mark.parametrize("kernel", ["mosaic", "triton"])
def test_auto_takes_the_mosaic_kernel_on_a_hopper(kernel, monkeypatch, cuda_lowering):
    """`auto` lowers a paged cache's attention with the indexer's counts (as the MLA layer calls it) onto the
    Mosaic kernel on a Hopper GPU (here a CPU told it is one), the default, and onto the Triton kernel with
    JAXMODELS_SPARSE_MLA_KERNEL=triton."""
    dispatch = importlib.import_module("pallas_kernels.sparse_mla_attention")  # the package's name is the function
    monkeypatch.setattr(dispatch, "KERNEL", kernel)
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    monkeypatch.setattr(dispatch, "is_hopper", lambda: True)
    monkeypatch.setattr(dispatch, "mosaic_kernels_available", lambda: True)
    S = jax.ShapeDtypeStruct
    text = cuda_lowering(jax.jit(lambda q, c, i, n: sparse_mla_attention(q, c, i, scale=0.04, listed=n)),
                         S((8, 128, 576), jnp.bfloat16), S((64, 64, 576), jnp.bfloat16), S((8, 2048), jnp.int32),
                         S((8,), jnp.int32))
    assert ("mosaic_gpu" in text) == (kernel == "mosaic")
