"""The server answers while the model loads: /health and the model routes give 503 with a "loading" reason until the
engine can serve, then 200; a model that fails to load is reported, not hung on."""

import threading

import httpx

from jaxmodels.serve.app import build_app
from jaxmodels.serve.server import BackgroundServer


def test_health_is_503_loading_until_the_model_is_loaded_then_200(reference):
    release = threading.Event()

    def load():
        assert release.wait(60), "the test never released the load"
        return reference

    with BackgroundServer(build_app(load=load, model_name="m")) as server:
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "loading"
        assert "loading" in health.json()["error"]["message"]
        early = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert early.status_code == 503
        assert early.json()["error"]["code"] == "loading"
        assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "m"  # known before loading ends
        release.set()
        for _ in range(600):
            health = httpx.get(f"{server.url}/health")
            if health.status_code == 200:
                break
            threading.Event().wait(0.05)
        assert health.status_code == 200
        assert health.json()["buckets_compiling"] == 0
        out = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2,
                                                                "ignore_eos": True}, timeout=120)
        assert out.json()["usage"]["completion_tokens"] == 2


def test_a_model_that_fails_to_load_is_reported_by_health_and_the_callback():
    failures = []

    def load():
        raise FileNotFoundError("no config.json in /nowhere")

    with BackgroundServer(build_app(load=load, model_name="m", on_load_failure=failures.append)) as server:
        for _ in range(600):
            if failures:
                break
            threading.Event().wait(0.05)
        assert failures == ["FileNotFoundError: no config.json in /nowhere"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "load_failed"
        assert "no config.json in /nowhere" in health.json()["error"]["message"]
