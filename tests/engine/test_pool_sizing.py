"""Cache pools sized from a memory budget: pages fill the budget left after the state slots."""

import dataclasses

import pytest

import jaxmodels
from jaxmodels.engine import cache
from jaxmodels.engine.cache import PoolSizes, pages_within, total_bytes
from jaxmodels.engine.step import ModelStep
from tests.hf_models import make_nemotron_h, save


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save(make_nemotron_h("dense"), tmp_path_factory.mktemp("sizing"))


def test_pages_fill_the_budget(checkpoint):
    step = ModelStep(jaxmodels.load_model(checkpoint, progress=False))
    sizes = PoolSizes.from_limits(max_batch_size=4, max_seq_len=64)
    budget = 3 * 2**20
    pages = pages_within(budget, step.cache_shapes, sizes)
    used = total_bytes(step.cache_shapes(PoolSizes(sizes.page_size, pages, sizes.num_slots, sizes.pages_per_seq)))
    more = total_bytes(step.cache_shapes(PoolSizes(sizes.page_size, pages + 1, sizes.num_slots,
                                                   sizes.pages_per_seq)))
    assert used <= budget < more


def test_too_small_a_budget_is_explained(checkpoint):
    step = ModelStep(jaxmodels.load_model(checkpoint, progress=False))
    sizes = PoolSizes.from_limits(max_batch_size=4, max_seq_len=64)
    with pytest.raises(ValueError, match="not enough for one request"):
        pages_within(10_000, step.cache_shapes, sizes)


@pytest.mark.cpu_only
def test_cpu_reports_no_memory():
    with pytest.raises(ValueError, match="memory_fraction needs a GPU"):
        cache.free_device_memory()


def test_llm_sizes_pages_from_memory_fraction(checkpoint, monkeypatch):
    monkeypatch.setattr("jaxmodels.engine.engine.free_device_memory", lambda devices=None: 8 * 2**20)
    llm = jaxmodels.LLM(checkpoint, dtype="float32", max_batch_size=4, max_seq_len=64, memory_fraction=0.5,
                        warmup=False, progress=False)
    sizes = llm.engine.sizes
    expected = pages_within(4 * 2**20, llm.engine.runner.step.cache_shapes, sizes)
    assert sizes.num_pages == expected > 1 + 4 * 4  # more than the limits alone would give
    out = llm.generate([[5, 6, 7]], jaxmodels.SamplingParams(max_new_tokens=3))
    assert len(out[0].token_ids) == 3


def test_default_state_snapshots_take_at_most_a_quarter_of_the_budget(checkpoint, monkeypatch):
    """Prefix caching's default snapshot count (1.25 per request slot: 5 here) shrinks to what a quarter of the
    pools' memory holds; a count given explicitly is kept."""
    step = ModelStep(jaxmodels.load_model(checkpoint, progress=False))
    sizes = PoolSizes.from_limits(max_batch_size=4, max_seq_len=16)
    per_snapshot = (total_bytes(step.cache_shapes(dataclasses.replace(sizes, num_snapshots=1)))
                    - total_bytes(step.cache_shapes(sizes)))
    budget = int(4 * 2.5 * per_snapshot)  # a quarter holds two and a half
    monkeypatch.setattr("jaxmodels.engine.engine.free_device_memory", lambda devices=None: 2 * budget)
    limits = dict(dtype="float32", max_batch_size=4, max_seq_len=16, memory_fraction=0.5, warmup=False,
                  progress=False)
    assert jaxmodels.LLM(checkpoint, **limits).engine.sizes.num_snapshots == 2
    assert jaxmodels.LLM(checkpoint, mamba_cache_slots=3, **limits).engine.sizes.num_snapshots == 3
