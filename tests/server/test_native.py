"""SGLang's service endpoints and CORS, on the tiny preset behind an API key."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from plugserve import __version__
from plugserve.runtime.engine import Engine
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.app import create_app

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def engine():
    engine = Engine(ServerArgs(model_preset="tiny", api_key=KEY, allowed_origins=f"{ORIGIN}, http://other.example",
                               served_model_name="m"))
    engine.ready.wait(60)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as client:
        yield client


def test_health_generate_runs_a_generation(client, engine):
    before = engine.metrics.registry.get_sample_value("plugserve_generation_tokens_total")
    response = client.get("/health_generate", headers=AUTH)
    assert response.status_code == 200
    assert engine.metrics.registry.get_sample_value("plugserve_generation_tokens_total") == before + 1


def test_model_and_server_info(client, engine):
    info = client.get("/get_model_info", headers=AUTH).json()
    assert info["is_generation"] is True and info["model_path"] == "tiny" and info["served_model_name"] == "m"
    server = client.get("/get_server_info", headers=AUTH).json()
    assert server == client.get("/server_info", headers=AUTH).json()
    assert server["version"] == __version__ and server["max_total_num_tokens"] == engine.runner.max_total_tokens
    assert client.get("/version", headers=AUTH).json() == {"version": __version__}


def test_flush_cache_empties_the_prefix_cache_when_idle_only(client, engine):
    prompt = "The same long prompt, cached after its first run. " * 4
    engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0))
    assert engine.radix.cached_pages > 0
    response = client.post("/flush_cache", headers=AUTH)
    assert (response.status_code, response.text) == (200, "Cache flushed.")
    assert engine.radix.cached_pages == 0
    # Busy: a request running when the flush comes leaves the cache as it is.
    first = threading.Event()
    engine.submit(prompt, SamplingParams(max_new_tokens=400, ignore_eos=True), lambda output: first.set(), rid="busy")
    assert first.wait(30)
    response = client.get("/flush_cache", headers=AUTH)
    engine.abort("busy")
    assert response.status_code == 400 and "requests are queued or running" in response.text


def test_tokenize_and_detokenize_round_trip(client, engine):
    text = "Hello, tokenizer!"
    body = client.post("/v1/tokenize", json={"model": "m", "prompt": text}, headers=AUTH).json()
    assert body["tokens"] == engine.tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.runner.context_length
    plain = client.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=AUTH).json()
    assert plain["tokens"] == body["tokens"][1:]  # without bos
    back = client.post("/v1/detokenize", json={"tokens": plain["tokens"]}, headers=AUTH).json()
    assert back == {"text": text}
    bad = client.post("/v1/detokenize", json={"tokens": [1, 10**9]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert client.post("/v1/tokenize", json={"text": text}, headers=AUTH).status_code == 400


def test_cors_preflight_is_answered_without_a_key_and_responses_carry_the_origin(client):
    preflight = client.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                           "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    response = client.get("/v1/models", headers=AUTH | {"Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in client.get("/v1/models", headers=AUTH | {
        "Origin": "http://evil.example"}).headers
    assert client.get("/v1/models").status_code == 401  # CORS lets the browser ask; the key still decides


def test_tokenize_refuses_lone_surrogates_and_negative_ids_naming_the_field(client):
    bad = client.post("/v1/tokenize", content=b'{"prompt": "a\\ud800b"}', headers=AUTH | {
        "Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid Unicode" in bad.json()["error"]["message"]
    negative = client.post("/v1/detokenize", json={"tokens": [3, -1]}, headers=AUTH)
    assert negative.status_code == 400 and "tokens.1" in negative.json()["error"]["message"]


def test_start_profile_for_some_steps_writes_its_files_and_stop_profile_ends_one(client, engine, tmp_path,
                                                                                 monkeypatch):
    response = client.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 2,
                                                   "activities": ["CPU"]}, headers=AUTH)
    assert (response.status_code, response.text) == (200, "Start profiling.")
    again = client.post("/start_profile", json={"output_dir": str(tmp_path)}, headers=AUTH)
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    engine.generate("profiled", SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert sorted(path.suffix for path in tmp_path.iterdir()) == [".gz", ".txt"]
    stopped = client.post("/stop_profile", headers=AUTH)
    assert stopped.status_code == 400 and "ended after its 2 steps" in stopped.json()["error"]["message"]
    # Until stopped: no body at all, as SGLang's scripts send it; the folder from SGLang's variable.
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path / "default"))
    assert client.post("/start_profile", headers=AUTH).status_code == 200
    engine.generate("profiled", SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True))
    stopped = client.post("/stop_profile", headers=AUTH)
    assert stopped.status_code == 200 and stopped.text.startswith("Stop profiling.")
    assert str(tmp_path / "default") in stopped.text


def test_start_profile_refuses_unknown_activities_and_fields(client):
    response = client.post("/start_profile", json={"activities": ["DISK"]}, headers=AUTH)
    assert response.status_code == 400 and "activities" in response.json()["error"]["message"]
    response = client.post("/start_profile", json={"steps": 3}, headers=AUTH)
    assert response.status_code == 400 and "steps" in response.json()["error"]["message"]
