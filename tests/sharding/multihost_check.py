"""Run as one of two processes of a multi-process JAX job on this host (4 simulated CPU devices each, gloo
collectives), for each tiny checkpoint in the directory given (one per family): an LLM(dp=4, tp=2) spanning both
processes' devices serves the greedy tokens of a 1-device LLM (which process 0 computes alone)

1. when every process calls generate with the same prompts;
2. when process 0 alone calls generate and process 1 follows it (LLM.lead / LLM.follow, engine.mirror);
3. through the HTTP server on process 0, process 1 following: concurrent completions of different lengths, while
   a streamed one is cancelled after its first token (an abort that process 1 must repeat too).

The environment carries JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, as a multi-host deployment
would, and `initialize_distributed` reads them.
"""

import concurrent.futures
import json
import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")  # before any device is touched

import httpx  # noqa: E402
import numpy as np  # noqa: E402

import jaxmodels  # noqa: E402
from sharding import initialize_distributed  # noqa: E402

# One prefill bucket and one decode bucket per dp group (max_batch_size / dp rows); each program compiles when first
# used ("none"), which every process does at the same step: the samplers of sampled and adjusted requests, which
# warm-up would compile in a multi-process job, are never needed here.
LIMITS = dict(dtype="float32", max_batch_size=8, max_seq_len=64, max_prefill_tokens=8, warmup="none", progress=False)
DP, TP = 4, 2


def greedy(max_new_tokens: int) -> jaxmodels.SamplingParams:
    return jaxmodels.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


def prompts_of(rng, lengths) -> list[list[int]]:
    return [rng.integers(3, 97, size=n).tolist() for n in lengths]


class Work:
    """The prompts of each check and their lengths of output; every process draws the same."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.every = prompts_of(rng, (1, 6, 13, 27))  # every process calls generate
        self.leader = prompts_of(rng, (5, 11))  # process 0 alone
        self.served = prompts_of(rng, (3, 9, 20))  # through the server
        self.served_tokens = [8, 4, 6]
        self.cancelled = prompts_of(rng, (4,))[0]

    def all(self):
        prompts = self.every + self.leader + self.served
        params = [greedy(8)] * len(self.every + self.leader) + [greedy(n) for n in self.served_tokens]
        return prompts, params


def tokens(outputs) -> list[list[int]]:
    return [output.token_ids for output in outputs]


def serve_and_compare(llm, work: Work, expected: list[list[int]]) -> None:
    from jaxmodels.serve.app import build_app
    from jaxmodels.serve.server import BackgroundServer

    with BackgroundServer(build_app(llm, model_name="tiny", max_queued_requests=8)) as server:
        def complete(prompt, max_tokens):
            body = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, return_token_ids=True)
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
            response.raise_for_status()
            return response.json()["choices"][0]["token_ids"]

        def cancel_after_first_token():
            body = dict(model="tiny", prompt=work.cancelled, max_tokens=48, temperature=0.0, stream=True)
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"]:
                        return  # closing the stream: the server aborts the request

        with concurrent.futures.ThreadPoolExecutor(len(work.served) + 1) as pool:
            cancelled = pool.submit(cancel_after_first_token)
            served = [pool.submit(complete, p, n) for p, n in zip(work.served, work.served_tokens)]
            got = [future.result() for future in served]
            cancelled.result()
        assert got == expected, (got, expected)
        wait_until_idle(server.url)


def wait_until_idle(url: str, timeout_s: float = 120) -> None:
    """Until the server's engine runs nothing (the cancelled request's abort included)."""
    deadline = time.monotonic() + timeout_s
    while "jaxmodels_requests_running 0.0" not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "the server's engine did not become idle"
        time.sleep(0.05)


def main(directory: str) -> None:
    assert initialize_distributed()
    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.devices())
    process = jax.process_index()
    work = Work()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if process == 0:  # the 1-device reference: an engine of its own on one of this process's devices
            expected = tokens(jaxmodels.LLM(path, decode_sizes=[8], **LIMITS).generate(*work.all()))
        llm = jaxmodels.LLM(path, dp=DP, tp=TP, decode_sizes=[LIMITS["max_batch_size"] // DP], **LIMITS)
        every = tokens(llm.generate(work.every, greedy(8)))
        if process == 0:
            assert every == expected[:len(work.every)], (name, every, expected)
            print(f"{name}: every process's generate serves the 1-device tokens")
            llm.lead()
            alone = tokens(llm.generate(work.leader, greedy(8)))
            assert alone == expected[len(work.every):][:len(work.leader)], (name, alone, expected)
            print(f"{name}: generate on process 0 alone, process 1 following, serves them")
            serve_and_compare(llm, work, expected[-len(work.served):])  # closing the app stops process 1
            print(f"{name}: the server on process 0 answers them")
        else:
            llm.follow()
            assert not llm.engine.has_work()  # the cancelled request was aborted here too
        print(f"{name}: process {process} ran {llm.metrics()['steps']} steps")


if __name__ == "__main__":
    main(sys.argv[1])
