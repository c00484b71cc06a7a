"""An engine that raises (a lost device, a bug) fails the requests in flight with its error instead of hanging
them, and the server answers 503 from then on."""

import httpx

import jaxmodels
from jaxmodels.serve.app import build_app
from jaxmodels.serve.server import BackgroundServer
from tests.serve.conftest import LIMITS


def test_a_failed_engine_ends_streams_with_the_error_and_answers_503(served_checkpoint, monkeypatch):
    llm = jaxmodels.LLM(served_checkpoint, **{**LIMITS, "warmup": False})

    def lost_device():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine, "step", lost_device)
    with BackgroundServer(build_app(llm, model_name="m")) as server:
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json={"prompt": [5, 6], "stream": True}) as response:
            events = [line for line in response.iter_lines() if line]
        assert "device lost" in events[0]
        assert '"error"' in events[0]
        assert events[-1] == "data: [DONE]"
        later = httpx.post(url, json={"prompt": [5, 6]})
        assert later.status_code == 503
        assert "device lost" in later.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
