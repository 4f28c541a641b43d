"""A real plugserve server on a loopback port, run by uvicorn in a background thread (fixture: `server`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from plugserve.runtime.engine import Engine
from plugserve.runtime.isolation import FaultHook
from plugserve.runtime.server_args import ServerArgs
from plugserve.server.app import create_app

API_KEY = "sk-plugserve-test"
SERVED_MODEL = "m"  # --served-model-name of the test servers: what the tests' requests name


@dataclass
class RunningServer:
    engine: Engine
    base_url: str

    def metric(self, name: str, **labels: str) -> float:
        """A sample of /metrics by name and labels (model_name aside); 0.0 when absent."""
        text = httpx.get(f"{self.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and {k: v for k, v in sample.labels.items() if k != "model_name"} == labels:
                    return sample.value
        return 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: ServerArgs, fault_hook: FaultHook | None = None) -> Iterator[RunningServer]:
    """A server of `args`; `fault_hook`: its engine's (`Engine`), to make chosen forwards fail."""
    engine = Engine(args, fault_hook=fault_hook)
    assert engine.ready.wait(60), "the engine did not warm up"
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield RunningServer(engine, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
