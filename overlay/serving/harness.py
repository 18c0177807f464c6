"""Start a `moe-overlay serve` server on loopback, talk to it, and always stop it.

Shared by the end-to-end tests and `make bench-cpu`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None = None  # sent as `Authorization: Bearer` when the server requires one

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        status, payload = self.request(path, body)
        if status != 200:
            raise RuntimeError(f"POST {path} -> {status}: {payload}")
        return payload


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}; log tail:\n{server.log()[-4000:]}")
        try:
            if server.request("/v1/models", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout:.0f} s; log tail:\n{server.log()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)  # vLLM's engine and workers are in the same group
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextmanager
def serve(config: str | Path, log_path: Path, env: dict[str, str] | None = None,
          extra_args: tuple[str, ...] = (), timeout: float = 420, api_key: str | None = None) -> Iterator[Server]:
    """Run `moe-overlay serve CONFIG` on a free loopback port until the block ends."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moe_overlay.cli", "serve", str(config), "--host", LOOPBACK,
             "--port", str(port), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
        )
    server = Server(process, port, log_path, api_key)
    try:
        _wait_ready(server, timeout)
        yield server
    finally:
        _stop(process)
