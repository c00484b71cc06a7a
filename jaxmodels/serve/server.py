"""Running the app under uvicorn: in the foreground (`python -m jaxmodels serve`) or on a background thread (tests,
the load benchmark)."""

import os
import signal
import socket
import threading
import time

import uvicorn

from jaxmodels.serve.app import build_app
from jaxmodels.serve.chat_template import ChatTemplate
from jaxmodels.serve.security import DEFAULT_MAX_REQUEST_BYTES


def load_app(model_dir: str, *, model_name: str, max_queued_requests: int, on_load_failure=None,
             api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
             reasoning_parser: str = "auto", tool_call_parser: str = "auto", **llm_options):
    """The app over an LLM of the checkpoint, loaded (weights, then the first buckets compiled) on a thread once
    the app starts: it answers /health with 503 "loading" meanwhile (see build_app)."""
    from jaxmodels.llm import LLM

    return build_app(load=lambda: LLM(model_dir, **llm_options), model_name=model_name,
                     chat_template=ChatTemplate.from_directory(model_dir), max_queued_requests=max_queued_requests,
                     on_load_failure=on_load_failure, api_key=api_key, max_request_bytes=max_request_bytes,
                     reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)


def stop_process(message: str) -> None:
    """`on_load_failure` of the command line's server: uvicorn shuts down on SIGTERM as on Ctrl-C."""
    os.kill(os.getpid(), signal.SIGTERM)


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

