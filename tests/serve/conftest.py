"""One real server (uvicorn on a free port of 127.0.0.1, on a thread) over a tiny checkpoint with a byte-level BPE
tokenizer and a chat template, and a second LLM on the same checkpoint to compute the expected tokens.

Limits are small so that compiling stays cheap on CPU (one prefill bucket of 16 tokens, one decode bucket of 8) and
max_seq_len is long (2048) so that a request left to run to the limit outlives any disconnect test by seconds.
"""

import dataclasses
import importlib.util
import re
import time

import pytest

# The server needs the [serve] extra and its tests the openai client; where they are missing (the GPU machine has
# no network to install them) the whole directory is skipped rather than failing at import.
SERVE_PACKAGES = ("fastapi", "uvicorn", "openai", "httpx")
if not all(importlib.util.find_spec(name) for name in SERVE_PACKAGES):
    collect_ignore_glob = ["test_*.py"]
else:
    import httpx

import jaxmodels

LIMITS = dict(dtype="float32", max_batch_size=8, max_seq_len=2048, prefill_sizes=[16], decode_sizes=[8],
              progress=False)
MAX_QUEUED = 32  # with 8 slots, the server holds 40 requests at once
MODEL = "tiny-nemotron"


@dataclasses.dataclass
class Served:
    url: str
    path: object  # the checkpoint directory
    client: object  # openai.OpenAI
    tokenizer: object  # tokenizers.Tokenizer

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics").text
        return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.MULTILINE)}

    def wait_until_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """The metrics once the engine runs no request (fails after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if metrics["jaxmodels_requests_running"] == 0 and metrics["jaxmodels_requests_waiting"] == 0:
                return metrics
            assert time.monotonic() < deadline, f"requests still running after {timeout} s: {metrics}"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    from tests.serve.checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="session")
def server(served_checkpoint):
    import openai

    from jaxmodels.serve.app import build_app
    from jaxmodels.serve.chat_template import ChatTemplate
    from jaxmodels.serve.server import BackgroundServer

    llm = jaxmodels.LLM(served_checkpoint, **LIMITS)
    app = build_app(llm, model_name=MODEL, chat_template=ChatTemplate.from_directory(served_checkpoint),
                    max_queued_requests=MAX_QUEUED)
    with BackgroundServer(app) as background:
        # No retries: a 503 must reach the test as it is.
        with openai.OpenAI(base_url=f"{background.url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield Served(background.url, served_checkpoint, client, llm.tokenizer)


@pytest.fixture(scope="session")
def reference(served_checkpoint):
    """LLM.generate on the same checkpoint and buckets, compiled on first use."""
    return jaxmodels.LLM(served_checkpoint, **{**LIMITS, "warmup": False})
