"""`plugserve serve` as a process: it checks host:port before loading the model (naming the flag), says what it
loads and how long loading and warm-up took, ends its start-up with "ready at ..." once /health is 200, and keeps
/health polls out of the access log."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.live_server import _free_port

REPO = Path(__file__).resolve().parents[2]
SERVE = [sys.executable, "-m", "plugserve", "serve", "--model-preset", "tiny", "--max-total-tokens", "4096"]


def _run(*flags: str, timeout: float = 60) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run([*SERVE, *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_a_busy_port_fails_before_the_model_loads_naming_the_flag():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, output, _ = _run("--port", str(port))
    assert status == 1
    assert f"--port {port} is in use on --host 127.0.0.1" in output
    assert "loading model" not in output


def test_a_bad_host_fails_naming_the_flag():
    status, output, _ = _run("--host", "no-such-host.invalid", "--port", "0")
    assert status == 1 and "--host 'no-such-host.invalid' is not an address or a known host name" in output


def test_start_up_lines_end_with_ready_and_health_polls_are_not_logged():
    port = _free_port()
    process = subprocess.Popen([*SERVE, "--port", str(port), "--served-model-name", "tiny-test"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        for _ in range(3):
            httpx.get(f"http://127.0.0.1:{port}/health")
        assert httpx.get(f"http://127.0.0.1:{port}/version").status_code == 200
        time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    lines = output.splitlines()
    loading = next(i for i, line in enumerate(lines) if "loading model tiny-test from --model-preset tiny" in line)
    loaded = next(i for i, line in enumerate(lines) if "model loaded in " in line)
    warm = next(i for i, line in enumerate(lines) if "warm-up done in " in line)
    uvicorn_up = next(i for i, line in enumerate(lines) if "Application startup complete" in line)
    ready = next(i for i, line in enumerate(lines) if f"ready at http://127.0.0.1:{port}, model tiny-test" in line)
    assert loading < loaded < warm < ready and uvicorn_up < ready
    assert '"GET /version HTTP/1.1" 200' in output and '"GET /health HTTP/1.1"' not in output
