"""The server never leaves a caller hanging: a scheduler loop that dies fails every waiting request at once,
/health says why and the process exits non-zero; SIGTERM refuses new requests (503), lets running ones
finish, ends the rest with an error when the grace period is all but over, and exits within it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from plugserve.runtime.engine import Engine, EngineStopped
from plugserve.runtime.request import FinishReason
from plugserve.runtime.sampling import SamplingParams
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.app import create_app
from tests.live_server import _free_port

REPO = Path(__file__).resolve().parents[2]
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # ~40 s on a CPU


def _fail(*_args, **_kwargs):
    raise RuntimeError("injected scheduler bug")


def test_a_dead_scheduler_loop_fails_every_caller_at_once_and_health_says_why(monkeypatch):
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=256))
    try:
        assert engine.ready.wait(30)
        release = threading.Event()
        deaths = []
        engine.on_death = deaths.append

        def step() -> None:  # the first step waits, so that requests pile up in the scheduler and its inbox
            release.wait(30)
            _fail()

        monkeypatch.setattr(engine.scheduler, "step", step)
        monkeypatch.setattr(engine.scheduler, "fail_all", _fail)  # the loop's own guard fails too: it dies
        params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        results = []
        callers = [threading.Thread(target=lambda: results.extend(engine.generate(["Hello", "Hi there"], params)))
                   for _ in range(3)]
        for caller in callers:
            caller.start()
        time.sleep(0.3)
        release.set()
        for caller in callers:
            caller.join(10)
            assert not caller.is_alive(), "a caller hung after the scheduler loop died"
        assert len(results) == 6 and all(r.finish_reason is FinishReason.ERROR for r in results)
        assert all("the scheduler loop died: RuntimeError: injected scheduler bug" in r.error for r in results)
        assert deaths == [results[0].error] and not engine.alive
        with pytest.raises(EngineStopped, match="loop died"):
            engine.submit("Hello", params, lambda _: None)
        client = TestClient(create_app(engine))
        health = client.get("/health")
        assert health.status_code == 503 and "retry-after" not in health.headers
        assert health.json()["error"]["message"] == results[0].error
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 503 and "loop died" in response.json()["error"]["message"]
    finally:
        engine.shutdown()


class _Fatal(BaseException):
    """What no `except Exception` catches (as a KeyboardInterrupt or a CUDA-side abort in a forward would)."""


def _fatal(*_args, **_kwargs):
    raise _Fatal("injected fatal error")


def test_a_base_exception_in_a_forward_fails_every_caller_and_reports_the_death(monkeypatch):
    """The step raises a BaseException, and so does the scheduler's shutdown, which waits on the forward in
    flight: every caller still gets its error and the owner hears of the death (it hung every client before)."""
    engine = Engine(ServerArgs(model_preset="tiny", max_total_tokens=256))
    try:
        assert engine.ready.wait(30)
        deaths, died = [], threading.Event()
        engine.on_death = lambda error: (deaths.append(error), died.set())
        monkeypatch.setattr(engine.scheduler, "step", _fatal)
        monkeypatch.setattr(engine.scheduler, "shutdown", _fatal)
        results, raised = [], []

        def call() -> None:
            try:
                results.extend(engine.generate(["Hello", "Hi"], SamplingParams()))
            except BaseException as exc:
                raised.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), "a caller hung after a BaseException in the loop"
        assert raised == []
        assert [r.finish_reason for r in results] == [FinishReason.ERROR] * 2
        assert died.wait(10), "the owner never heard of the death"  # reported after the callers' errors
        assert deaths == [results[0].error] and "_Fatal: injected fatal error" in deaths[0]
        assert not engine.alive
    finally:
        monkeypatch.undo()
        engine.shutdown()


# -- the process (a subprocess server on the tiny preset, whose context holds the long requests) ----------

SERVE = "import sys; from plugserve.server.launch import main; main(sys.argv[1:])"
# The same, with a scheduler whose steps and whose guard both raise: the loop dies on the first request.
SERVE_DOOMED = ("import sys; from plugserve.runtime.scheduler import Scheduler; "
                "from tests.server.test_lifecycle import _fail; Scheduler.step = Scheduler.fail_all = _fail; "
                + SERVE.split("; ", 1)[1])


@contextlib.contextmanager
def _spawn(code: str, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-c", code, "--port", str(port), "--max-total-tokens", "4096",
                                "--model-preset", "tiny", "--log-level", "warning", *flags], cwd=REPO,
                               env=os.environ | {"PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield process, base
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_the_process_exits_non_zero_when_its_scheduler_loop_dies():
    with _spawn(SERVE_DOOMED) as (process, base):
        started = time.monotonic()
        response = httpx.post(f"{base}/v1/completions", json=LONG, timeout=30)
        assert response.status_code == 500
        assert "the scheduler loop died: RuntimeError: injected scheduler bug" in response.json()["error"]["message"]
        assert process.wait(15) == 1
        assert time.monotonic() - started < 10
        assert "the scheduler loop died" in process.stdout.read()


def test_sigterm_refuses_new_requests_lets_short_ones_finish_and_exits_within_the_grace_period():
    grace = 5.0
    with _spawn(SERVE, "--graceful-shutdown-timeout", str(grace)) as (process, base):
        with httpx.Client(base_url=base, timeout=60) as client:
            outcomes: dict[str, object] = {}

            def stream(name: str, max_tokens: int, started: threading.Event) -> None:
                body = LONG | {"max_tokens": max_tokens, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    events = []
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            events.append(line.removeprefix("data: "))
                            started.set()
                outcomes[name] = [json.loads(e) for e in events[:-1]], events[-1]

            def plain() -> None:
                outcomes["long"] = client.post("/v1/completions", json=LONG)

            short_started, long_started = threading.Event(), threading.Event()
            threads = [threading.Thread(target=stream, args=("short", 40, short_started)),
                       threading.Thread(target=stream, args=("long stream", 3000, long_started)),
                       threading.Thread(target=plain)]
            for thread in threads:
                thread.start()
            assert short_started.wait(30) and long_started.wait(30)
            time.sleep(0.2)  # the non-streaming one is in too

            sigterm = time.monotonic()
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            health = httpx.get(f"{base}/health", timeout=5)
            assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]

            assert process.wait(grace + 5) == 0
            exited = time.monotonic() - sigterm
            for thread in threads:
                thread.join(5)
                assert not thread.is_alive(), "a request hung through the shutdown"
        assert exited <= grace + 0.5, f"exited {exited:.1f} s after SIGTERM, the grace period is {grace} s"
        chunks, last = outcomes["short"]
        assert last == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) > 0
        chunks, _ = outcomes["long stream"]
        assert "shut down before the request finished" in chunks[-1]["error"]["message"]
        long = outcomes["long"]
        assert long.status_code == 500 and "shut down before the request finished" in long.json()["error"]["message"]
