"""Load and faults on the served tiny Mixtral: a small load run (no failures but the planned
cancellations, healthy afterwards), SIGTERM with requests in flight (each finishes or is refused
cleanly, exit 0), and the engine process killed (the server exits non-zero, saying why, within
seconds). The first server takes its API key from the environment (VLLM_API_KEY) and enforces it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.config import API_KEY_ENV
from moe_overlay.serving.harness import Server, serve
from moe_overlay.serving.lifecycle import STOPPED
from moe_overlay.serving.load import run_load
from tests.e2e import ROOT

CONFIG = ROOT / "configs" / "tiny-mixtral.yaml"
MODEL = "tiny-mixtral"
IN_FLIGHT = 3
LONG = 400  # tokens: still generating when the signal comes
EXIT_WITHIN_S = 30
ENV_KEY = "sk-from-the-environment-4d2c"


def _stream(server: Server, results: list, started: threading.Semaphore) -> None:
    """One long streaming completion; records how it ended and how many tokens it got: the
    server's own count where its closing usage event came (vLLM may put several tokens in one
    event when the engine runs ahead of the stream), else the events'."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {ENV_KEY}"})
    events, usage, finish, done, refused = 0, None, None, False, None
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        refused = event["error"]["message"]
                        continue
                    if event.get("usage"):  # the closing event: no choices
                        usage = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        events += 1
                        finish = choice.get("finish_reason") or finish
                        if events == 1:
                            started.release()
        tokens = events if usage is None else usage
        results.append({"ok": True, "tokens": tokens, "finish": finish, "done": done, "refused": refused})
    except urllib.error.HTTPError as err:  # refused before it started
        message = json.loads(err.read() or b"{}").get("error")
        results.append({"ok": err.code == 503, "tokens": 0, "done": False, "refused": message, "status": err.code})
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        results.append({"ok": False, "tokens": events, "error": repr(err)})


def _engine_core(server: Server) -> int:
    """The engine-core process among the server's descendants (vLLM names it VLLM::EngineCore)."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                pgid = int(f.read().rsplit(")", 1)[1].split()[2])
        except OSError:
            continue
        if pgid == server.process.pid and b"EngineCore" in cmdline:
            return pid
    raise AssertionError("no EngineCore process in the server's process group")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A small load run, then SIGTERM to the server process while requests stream."""
    ensure_builtin(MODEL)
    log = tmp_path_factory.mktemp("faults") / "sigterm.log"
    runs: dict = {}
    with serve(CONFIG, log, {API_KEY_ENV: ENV_KEY}, api_key=ENV_KEY) as server:
        runs["without_key"] = Server(server.process, server.port, server.log_path).request("/v1/moe")[0]
        runs["load"] = run_load(server.base_url, clients=6, requests=30, max_seconds=240,
                                prompt_lengths=[8, 64, 200], output_lengths=[4, 16, 48],
                                server_pid=server.process.pid, api_key=ENV_KEY)
        results: list = []
        started = threading.Semaphore(0)
        threads = [threading.Thread(target=_stream, args=(server, results, started)) for _ in range(IN_FLIGHT)]
        for thread in threads:
            thread.start()
        assert all(started.acquire(timeout=120) for _ in threads), "the streams never started"
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)  # what systemd or docker stop sends to the main process
        runs["returncode"] = server.process.wait(timeout=120)
        runs["exit_s"] = time.monotonic() - start
        for thread in threads:
            thread.join(timeout=120)
        runs["streams"] = results
        try:
            urllib.request.urlopen(server.base_url + "/v1/models", timeout=5)
            runs["after"] = "answered"
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            runs["after"] = repr(err)
    runs["log"] = server.log()
    return runs


def test_load_run_has_no_failures_and_leaves_the_server_healthy(stopped):
    report = stopped["load"]
    assert report.failed == 0 and report.not_sent == 0, report.failures
    assert report.cancelled == 3 and report.completed == 27  # one in ten cancelled mid-stream
    assert report.healthy_after
    assert report.ttft_ms["p50"] is not None and report.per_token_ms["p99"] is not None
    assert report.server_rss_mib["before"] and report.server_rss_mib["after"]


def test_a_key_from_the_environment_is_enforced_and_never_logged(stopped):
    assert stopped["without_key"] == 401
    assert "every route requires the API key" in stopped["log"] and ENV_KEY not in stopped["log"]


def test_sigterm_lets_requests_finish_or_refuses_them_cleanly_and_exits_0(stopped):
    assert stopped["returncode"] == 0, stopped["log"][-3000:]
    assert stopped["exit_s"] < EXIT_WITHIN_S
    assert len(stopped["streams"]) == IN_FLIGHT
    for stream in stopped["streams"]:
        assert stream["ok"], stream  # the response ended in order: not reset, not left hanging
        finished = stream["done"] and stream["finish"] == "length" and stream["tokens"] == LONG
        aborted = stream["done"] and stream["finish"] == "abort"  # vLLM's own word for it
        refused = not stream["done"] and stream["refused"] == STOPPED  # the overlay ended it
        assert [finished, aborted, refused].count(True) == 1, stream
    assert "answered" not in stopped["after"]  # and nothing is served after the exit


@pytest.fixture(scope="module")
def engine_killed(tmp_path_factory):
    ensure_builtin(MODEL)
    log = tmp_path_factory.mktemp("faults") / "killed.log"
    with serve(CONFIG, log) as server:
        os.kill(_engine_core(server), signal.SIGKILL)
        start = time.monotonic()
        try:
            returncode = server.process.wait(timeout=120)
        except subprocess.TimeoutExpired:  # a hang is the finding; the harness stops it
            returncode = None
        elapsed = time.monotonic() - start
    return {"returncode": returncode, "elapsed": elapsed, "log": server.log()}


def test_engine_killed_the_server_exits_non_zero_within_seconds(engine_killed):
    assert engine_killed["returncode"] not in (None, 0), engine_killed["log"][-3000:]
    assert engine_killed["elapsed"] < EXIT_WITHIN_S
    assert "[moe-overlay] the engine process died while serving" in engine_killed["log"]
