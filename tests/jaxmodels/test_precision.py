"""A model's dtype is its compute precision: every XLA dot of a float32 model is HIGHEST (the GPU would otherwise
run it as TF32), whatever global default a user set; bfloat16 models keep the fast default; `matmul_precision`
overrides. Checked on the lowered programs, which are the same on CPU and GPU."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxmodels.engine.step import ModelStep
from jaxmodels.families import load_config, model_class
from tests.hf_models import TINY_CONFIGS


def build(model_type, dtype, matmul_precision=None):
    config = load_config(TINY_CONFIGS[model_type])
    return model_class(config)(config, dtype=dtype, matmul_precision=matmul_precision, rngs=nnx.Rngs(0))


def dot_precisions(lowered_text: str) -> list[tuple[str, str]]:
    """(precision, lhs operand type) of every dot_general in a lowered program."""
    return re.findall(r"dot_general.*?precision = \[(\w+), \w+\] : \(tensor<[^>]*x(\w+)>", lowered_text)


def forward_text(model) -> str:
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 5), jnp.int32)
    return jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)).lower(state, ids).as_text()


@pytest.fixture
def user_default_bfloat16():
    """A user who set the global default to bfloat16 dots: a float32 model must not follow it."""
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    yield
    jax.config.update("jax_default_matmul_precision", previous)


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_float32_models_run_every_dot_at_highest(model_type, user_default_bfloat16):
    dots = dot_precisions(forward_text(build(model_type, jnp.float32)))
    assert dots
    assert {precision for precision, _ in dots} == {"HIGHEST"}


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_bfloat16_models_keep_the_default_except_float32_routing(model_type):
    dots = dot_precisions(forward_text(build(model_type, jnp.bfloat16)))
    assert {precision for precision, dtype in dots if dtype == "bf16"} == {"DEFAULT"}
    # The router (and the DSA indexer's head weights) are float32 products kept exact, as transformers does.
    assert {precision for precision, dtype in dots if dtype == "f32"} == {"HIGHEST"}


def test_matmul_precision_overrides_the_dtype():
    dots = dot_precisions(forward_text(build("nemotron_h", jnp.float32, matmul_precision="tensorfloat32")))
    assert {precision for precision, _ in dots} == {"HIGH", "HIGHEST"}  # TF32 everywhere but the router


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_engine_steps_run_at_the_models_precision(model_type, user_default_bfloat16):
    from jaxmodels.engine.cache import PoolSizes
    from jaxmodels.engine.runner import Runner

    step = ModelStep(build(model_type, jnp.float32))
    sizes = PoolSizes.from_limits(max_batch_size=2, max_seq_len=16)
    runner = Runner(step, sizes, decode_sizes=[2], prefill_sizes=[8], max_seqs_per_extend=2)
    for kind in ("extend", "decode"):
        dots = dot_precisions(runner.programs.lower((kind, 8 if kind == "extend" else 2)).as_text())
        assert {precision for precision, _ in dots} == {"HIGHEST"}, kind
