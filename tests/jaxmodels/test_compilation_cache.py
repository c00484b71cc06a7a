"""The persistent compilation cache: a second process with the same checkpoint and limits loads every step program
the first one compiled, and generates the same tokens; where the cache lives when nothing names it, and "off"."""

import json
import os
import subprocess
import sys

from tests.hf_models import make_nemotron_h, save

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# One engine start in a fresh process: warm-up of a few buckets, a greedy generate, and JAX's cache counters. Warm-up
# "all" compiles the buckets before serving and nothing in the background (the default would go on compiling the
# samplers of sampled requests, which a greedy generate never uses, racing the process's exit: the two starts must
# compile the same programs).
START = """
import json, sys
import jax
import jaxmodels

counts = {"requests": 0, "hits": 0}
names = {"/jax/compilation_cache/compile_requests_use_cache": "requests", "/jax/compilation_cache/cache_hits": "hits"}

def count(event, **kwargs):
    if event in names:
        counts[names[event]] += 1

jax.monitoring.register_event_listener(count)
path, cache = sys.argv[1:]
llm = jaxmodels.LLM(path, dtype="float32", max_batch_size=2, max_seq_len=64, prefill_sizes=[16],
                    decode_sizes=[1, 2], warmup="all", progress=False, compilation_cache_dir=cache)
outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], jaxmodels.SamplingParams(max_new_tokens=6, temperature=0.0))
print(json.dumps(dict(counts, tokens=[o.token_ids for o in outs])))
"""


def clean_env() -> dict:
    """This process's environment without a JAX cache of its own (the GPU suite sets one for all its tests)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAXMODELS_COMPILATION_CACHE_DIR", None)
    return env


def start_engine(path, cache) -> dict:
    result = subprocess.run([sys.executable, "-c", START, str(path), str(cache)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_and_gives_the_same_tokens(tmp_path):
    path = save(make_nemotron_h("dense"), tmp_path / "model")
    cache = tmp_path / "cache"
    cold = start_engine(path, cache)
    assert cold["requests"] > 0 and cold["hits"] == 0
    assert len(os.listdir(cache)) > 0
    warm = start_engine(path, cache)
    assert warm["requests"] == cold["requests"]
    assert warm["hits"] == warm["requests"]  # nothing compiled again: model building, warm-up and sampling
    assert warm["tokens"] == cold["tokens"]


def test_the_command_line_fills_the_cache_directory(tmp_path):
    from tests.jaxmodels.test_cli import run_cli

    path = save(make_nemotron_h("dense"), tmp_path / "model")
    cache = tmp_path / "cache"
    out = run_cli("generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--dtype",
                  "float32", "--max-seq-len", "64", "--compilation-cache", str(cache))
    assert "[3 tokens" in out
    assert len(os.listdir(cache)) > 0


# A fresh process: the engine's choice of cache directory, then one compilation, which JAX stores there if anything.
CHOOSE = """
import json
import jax, jax.numpy as jnp
from jaxmodels.compilation_cache import use_compilation_cache

directory = use_compilation_cache()
jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)).block_until_ready()
print(json.dumps(dict(directory=directory)))
"""


def choose_directory(tmp_path, **env) -> str | None:
    result = subprocess.run([sys.executable, "-c", CHOOSE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=dict(clean_env(), XDG_CACHE_HOME=str(tmp_path / "xdg"), **env))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["directory"]


def test_by_default_the_cache_lives_under_the_user_cache_directory(tmp_path):
    default = tmp_path / "xdg" / "jaxmodels" / "xla"
    assert choose_directory(tmp_path) == str(default)
    assert len(os.listdir(default)) > 0  # the one program compiled, stored


def test_off_turns_the_engines_cache_off_and_jax_own_setting_is_kept(tmp_path):
    assert choose_directory(tmp_path, JAXMODELS_COMPILATION_CACHE_DIR="off") is None
    assert not (tmp_path / "xdg").exists()
    own = tmp_path / "jax_own"
    assert choose_directory(tmp_path, JAX_COMPILATION_CACHE_DIR=str(own)) == str(own)
    assert not (tmp_path / "xdg").exists()
