"""While the engine warms up (JIT compiles, CUDA-graph capture) the server says so: /health 503 with
Retry-After, generation endpoints 503, read-only ones answer; then everything serves."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from plugserve.runtime import engine as engine_module
from plugserve.runtime.engine import Engine
from plugserve.runtime.model_runner import ModelRunner
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.app import create_app


@pytest.fixture
def gated_warm_up(monkeypatch) -> threading.Event:
    """The engine's warm-up blocks until the returned event is set."""
    release = threading.Event()
    release.kwargs = {}
    original = engine_module.warm_up

    def warm_up(runner: ModelRunner, **kwargs) -> None:
        release.kwargs.update(kwargs)
        release.wait(30)
        original(runner, **kwargs)

    monkeypatch.setattr(engine_module, "warm_up", warm_up)
    return release


def test_requests_wait_for_warm_up_with_503_and_then_serve(gated_warm_up):
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=256, served_model_name="m"))
    try:
        client = TestClient(create_app(engine))
        health = client.get("/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        assert "warming up" in health.json()["error"]["message"]
        completion = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 503 and "warming up" in completion.json()["error"]["message"]
        info = client.get("/server_info").json()
        assert info["ready"] is False and info["cuda_graph"] == "no CUDA graphs on the CPU"
        assert client.get("/v1/models").status_code == 200

        gated_warm_up.set()
        assert engine.ready.wait(30)
        assert client.get("/health").json() == {"status": "ok"}
        completion = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
        # Kernels compiled after the warm-up count in /metrics (none on the CPU: nothing compiles there).
        assert gated_warm_up.kwargs["on_late_compile"] == engine.metrics.late_triton_compiles.inc
        assert 'plugserve_late_triton_compiles_total{model_name="m"} 0.0' in client.get("/metrics").text
    finally:
        gated_warm_up.set()
        engine.shutdown()


def test_a_failed_warm_up_is_reported_and_never_serves(monkeypatch):
    def fail(runner: ModelRunner, **kwargs) -> None:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(engine_module, "warm_up", fail)
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=256))
    try:
        engine._thread.join(10)
        client = TestClient(create_app(engine))
        health = client.get("/health")
        assert health.status_code == 503 and "retry-after" not in health.headers
        assert health.json()["error"]["message"] == "warm-up failed: RuntimeError: CUDA error: out of memory"
        assert client.post("/generate", json={"text": "Hi"}).status_code == 503
    finally:
        engine.shutdown()
