"""Running the app under uvicorn: in the foreground (`python -m jaxmodels serve`) or on a background thread (tests,
the load benchmark)."""

import socket
import threading
import time

import uvicorn

from jaxmodels.serve.app import build_app
from jaxmodels.serve.chat_template import ChatTemplate


def load_app(model_dir: str, *, model_name: str, max_queued_requests: int, **llm_options):
    """Load the checkpoint into an LLM (compiling its buckets) and build the app around it."""
    from jaxmodels.llm import LLM

    llm = LLM(model_dir, **llm_options)
    return build_app(llm, model_name=model_name, chat_template=ChatTemplate.from_directory(model_dir),
                     max_queued_requests=max_queued_requests)


def serve_forever(app, host: str, port: int) -> None:
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """uvicorn serving `app` on a thread of this process, on a free port of 127.0.0.1; use as a context manager."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None):
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()

