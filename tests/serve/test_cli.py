"""`python -m jaxmodels serve` as a user runs it, with `--model` a Hugging Face Hub id resolved offline from a Hub
cache the test fills itself (the layout huggingface_hub reads: refs/main names the snapshot directory); and as a
process k > 0 of a multi-process job runs it (tests/sharding/multihost_check.py serves across two processes)."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from jaxmodels.serve.server import free_port
from tests.serve.checkpoint import write_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = "test-org/tiny-chatless"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    """An offline environment whose Hub cache holds REPO: a checkpoint with a tokenizer but no chat template."""
    cache = tmp_path_factory.mktemp("hub_cache")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    write_checkpoint(snapshot, chat_template=None)
    return dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)


def test_serve_a_hub_id_from_the_offline_cache(hub_env, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "jaxmodels", "serve", "--model", REPO, "--port", str(port),
                                    "--dtype", "float32", "--max-batch-size", "2", "--max-seq-len", "64",
                                    "--max-prefill-tokens", "16", "--no-warmup"],
                                   cwd=ROOT, env=hub_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up in 300 s"
            time.sleep(0.5)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == REPO
        out = httpx.post(f"{url}/v1/completions", json={"model": REPO, "prompt": [5, 6, 7], "max_tokens": 3,
                                                        "ignore_eos": True}, timeout=120).json()
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400
        assert "no chat template" in chat.json()["error"]["message"]
    finally:
        process.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully: the engine thread stops, exit 0
        returncode = process.wait(timeout=60)
    assert returncode == 0, log_path.read_text()[-3000:]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def test_an_uncached_hub_id_offline_is_a_clear_error(hub_env):
    result = subprocess.run([sys.executable, "-m", "jaxmodels", "serve", "--model", "test-org/not-cached"],
                            cwd=ROOT, env=hub_env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "test-org/not-cached" in result.stderr
    assert "Hugging Face Hub id" in result.stderr


def test_generate_takes_a_hub_id_too(hub_env):
    """LLM(path) resolves Hub ids, so every command that loads a model does."""
    result = subprocess.run([sys.executable, "-m", "jaxmodels", "generate", "--model", REPO, "--prompt-ids", "5,6,7",
                             "--max-new-tokens", "2", "--dtype", "float32", "--max-seq-len", "64"],
                            cwd=ROOT, env=hub_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 tokens" in result.stdout


class Follower:
    """`serve` as process 1 of a multi-process job runs it, with `follow_leader` recording its arguments (and raising
    `failure`, if set) instead of loading the model."""

    def __init__(self):
        self.calls, self.failure = [], None

    def follow_leader(self, model_dir, **options):
        self.calls.append((model_dir, options))
        if self.failure is not None:
            raise self.failure

    def serve(self, *argv):
        from jaxmodels.__main__ import main

        main(["serve", *argv])


@pytest.fixture
def follower(monkeypatch):
    import logging

    import jax

    from jaxmodels.serve import server

    follower = Follower()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(server, "follow_leader", follower.follow_leader)
    monkeypatch.setattr(server, "serve_forever", lambda *args: pytest.fail("a follower serves HTTP"))
    level = logging.getLogger("jaxmodels").level
    yield follower
    logging.getLogger("jaxmodels").setLevel(level)  # main() sets it to INFO


def test_serve_on_a_process_above_0_follows_with_the_engine_options(follower, tmp_path):
    """docs/multihost.md: the followers take process 0's engine options and answer no HTTP."""
    follower.serve("--model", str(tmp_path), "--dp", "4", "--tp", "2", "--max-batch-size", "8", "--port", "1")
    ((model_dir, options),) = follower.calls
    assert model_dir == str(tmp_path)
    assert (options["dp"], options["tp"], options["max_batch_size"]) == (4, 2, 8)


def test_a_follower_whose_job_fails_exits_with_the_reason(follower, tmp_path):
    from jaxmodels.engine.mirror import MirrorFailed

    follower.failure = MirrorFailed("process 0 stopped the job: process 0's engine failed: RuntimeError: boom")
    with pytest.raises(SystemExit, match="^error: process 0 stopped the job: process 0's engine failed"):
        follower.serve("--model", str(tmp_path))
