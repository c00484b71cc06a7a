"""Running the app under uvicorn: in the foreground (`python -m jaxmodels serve`) or on a background thread (tests,
the load benchmark)."""

import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from jaxmodels.serve.app import build_app
from jaxmodels.serve.chat_template import ChatTemplate
from jaxmodels.serve.security import DEFAULT_MAX_REQUEST_BYTES

JOB_EXIT_GRACE_S = 30

log = logging.getLogger("jaxmodels.serve")


def load_app(model_dir: str, *, model_name: str, max_queued_requests: int, on_load_failure=None,
             on_job_failure=None, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
             reasoning_parser: str = "auto", tool_call_parser: str = "auto", **llm_options):
    """The app over an LLM of the checkpoint, loaded (weights, then the first buckets compiled) on a thread once
    the app starts: it answers /health with 503 "loading" meanwhile (see build_app). In a multi-process job this
    is process 0's, which the others follow (`follow_leader`); `on_job_failure(reason)` is called if one fails."""
    import jax

    from jaxmodels.llm import LLM

    several = jax.process_count() > 1
    job_failures = []

    def job_failed(reason: str) -> None:
        job_failures.append(reason)
        if on_job_failure is not None:
            on_job_failure(reason)

    def load():
        llm = LLM(model_dir, **llm_options)
        if several:
            llm.lead(on_failure=job_failed)
        return llm

    def leave_job() -> None:
        # Every process leaves the JAX job together (its coordinator's shutdown barrier) before this one exits:
        # uvicorn ends the process by raising again the SIGTERM or SIGINT it stopped on, which skips the exit
        # handler that would, and followers that lose the coordinator abort. Not after a failure: a process that
        # failed may never come to the barrier.
        if not job_failures:
            jax.distributed.shutdown()

    return build_app(load=load, on_shutdown=leave_job if several else None, model_name=model_name,
                     chat_template=ChatTemplate.from_directory(model_dir), max_queued_requests=max_queued_requests,
                     on_load_failure=on_load_failure, api_key=api_key, max_request_bytes=max_request_bytes,
                     reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)


def follow_leader(model_dir: str, **llm_options) -> None:
    """A process k > 0 of a multi-process server: no HTTP, the same LLM as process 0's, stepping with it until it
    stops (jaxmodels.engine.mirror)."""
    from jaxmodels.llm import LLM

    LLM(model_dir, **llm_options).follow()


def stop_process(message: str) -> None:
    """`on_load_failure` of the command line's server: uvicorn shuts down on SIGTERM as on Ctrl-C."""
    os.kill(os.getpid(), signal.SIGTERM)


def stop_job(message: str) -> None:
    """`on_job_failure` of the command line's server: shut down as `stop_process` does, and if that has not ended
    the process after JOB_EXIT_GRACE_S, exit at once: the engine thread may be waiting forever on the device for
    the process that failed."""
    stop_process(message)
    timer = threading.Timer(JOB_EXIT_GRACE_S, _exit_now, (message,))
    timer.daemon = True
    timer.start()


def _exit_now(message: str) -> None:
    log.error("error: %s; the engine did not stop within %d s (it waits on the device for that process): exiting",
              message, JOB_EXIT_GRACE_S)
    os._exit(1)


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

