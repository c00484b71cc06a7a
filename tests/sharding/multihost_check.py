"""Run as one of two processes of a multi-process JAX job on this host (2 simulated CPU devices each, gloo
collectives): the job's LLM(dp=2, tp=2) spans both processes' devices and serves the tokens of a 1-device LLM.

The environment carries JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, as a multi-host deployment
would, and `initialize_distributed` reads them.
"""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before any device is touched

import numpy as np  # noqa: E402

import jaxmodels  # noqa: E402
from sharding import initialize_distributed  # noqa: E402

LIMITS = dict(dtype="float32", max_batch_size=8, max_seq_len=64, max_prefill_tokens=8, progress=False)


def main(path: str) -> None:
    assert initialize_distributed()
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (1, 6, 13, 27)]
    greedy = jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.0)
    alone = [o.token_ids for o in jaxmodels.LLM(path, **LIMITS).generate(prompts, greedy)]
    job = [o.token_ids for o in jaxmodels.LLM(path, dp=2, tp=2, **LIMITS).generate(prompts, greedy)]
    assert job == alone, (job, alone)
    print(f"process {jax.process_index()}: dp=2 tp=2 over 2 processes serves the 1-device tokens")


if __name__ == "__main__":
    main(sys.argv[1])
