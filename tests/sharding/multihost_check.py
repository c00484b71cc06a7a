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
# One decode bucket per dp group (max_batch_size / dp rows): a multi-process job compiles every bucket, with its
# on-demand samplers, before serving (engine.warmup), and the default lists hold six and four decode sizes.
DECODE_SIZES = {1: [8], 2: [4]}


def main(path: str) -> None:
    assert initialize_distributed()
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 97, size=n).tolist() for n in (1, 6, 13, 27)]
    greedy = jaxmodels.SamplingParams(max_new_tokens=8, temperature=0.0)

    def served(dp: int, tp: int) -> list[list[int]]:
        llm = jaxmodels.LLM(path, dp=dp, tp=tp, decode_sizes=DECODE_SIZES[dp], **LIMITS)
        return [o.token_ids for o in llm.generate(prompts, greedy)]

    alone, job = served(1, 1), served(2, 2)
    assert job == alone, (job, alone)
    print(f"process {jax.process_index()}: dp=2 tp=2 over 2 processes serves the 1-device tokens")


if __name__ == "__main__":
    main(sys.argv[1])
