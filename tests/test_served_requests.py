"""One served tiny Mixtral with an API key (from the config): bad requests get a 4xx with a clear
message and the next good request is answered as before; the key guards every route, /v1/moe
included, and never shows up in the log, /v1/moe or the start-up lines. The config asks for the
AITER backend without strict mode: on a CPU each layer falls back and the log and /v1/moe say why."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import yaml

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import Server, serve
from tests.e2e import ROOT

CONFIG = ROOT / "configs" / "tiny-mixtral.yaml"
MODEL = "tiny-mixtral"
KEY = "sk-served-5e1f3a9c0b7d"
JSON = "application/json"
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # so the dev routes (/collective_rpc, /pause...) exist to be guarded


def _call(server: Server, path: str, body: bytes | None = None, content_type: str = JSON,
          key: str | None = KEY, method: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server.base_url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _good(server: Server) -> list[int]:
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    status, payload = _call(server, "/v1/completions", json.dumps(body).encode())
    assert status == 200, payload
    return json.loads(payload)["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ensure_builtin(MODEL)
    work = tmp_path_factory.mktemp("served")
    raw = yaml.safe_load(CONFIG.read_text())
    raw["server"]["api_key"] = KEY
    raw["moe"] = {"backend": "aiter", "strict": False}  # not on a CPU: falls back, and says so
    config = work / "keyed.yaml"
    config.write_text(yaml.safe_dump(raw))
    with serve(config, work / "server.log", DEV_MODE, api_key=KEY) as running:
        running.reference = _good(running)  # type: ignore[attr-defined]
        yield running


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4, **fields}).encode()


BAD_REQUESTS = {
    # id: (path, body, content type, expected status, words the message must contain)
    "malformed-json": ("/v1/completions", b'{"model": "tiny-mixtral", "prompt": ', JSON, 400, "JSON decode error"),
    "wrong-content-type": ("/v1/completions", _completion(), "text/plain", 400, "application/json"),
    "negative-max-tokens": ("/v1/completions", _completion(max_tokens=-1), JSON, 400, "max_tokens must be at least 1"),
    "huge-max-tokens": ("/v1/completions", _completion(max_tokens=10**9), JSON, 400, "max_model_len=512"),
    "prompt-too-long": ("/v1/completions", _completion(prompt="x" * 600), JSON, 400, "maximum context length is 512"),
    "unknown-model": ("/v1/completions", _completion(model="no-such-model"), JSON, 404, "does not exist"),
    "absurd-n": ("/v1/completions", _completion(n=100_000), JSON, 400, "n must be at most"),
    "absurd-logprobs": ("/v1/completions", _completion(logprobs=100_000), JSON, 400, "max allowed: 20"),
    "absurd-top-logprobs": ("/v1/chat/completions",
                            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "logprobs": True, "top_logprobs": 100_000}).encode(), JSON, 400,
                            "max allowed: 20"),
    # Starlette's own words; the status and the server's state are the promise here
    "invalid-utf8": ("/v1/completions", b'{"model": "tiny-mixtral", "prompt": "\xff\xfe", "max_tokens": 2}', JSON, 400,
                     "error parsing the body"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_request_is_a_clear_4xx_and_the_server_stays_up(server, case):
    path, body, content_type, expected, words = BAD_REQUESTS[case]
    status, payload = _call(server, path, body, content_type)
    assert status == expected, payload
    assert words in payload.decode(errors="replace"), payload
    assert server.process.poll() is None
    assert _good(server) == server.reference


ROUTES = [("GET", "/v1/moe"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/tokenize"),
          ("POST", "/tokenize"), ("GET", "/metrics"), ("GET", "/health"), ("GET", "/load"), ("GET", "/version"),
          ("GET", "/server_info"), ("POST", "/collective_rpc"), ("POST", "/pause"), ("GET", "/openapi.json")]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_needs_the_key(server, method, path):
    body = b"{}" if method == "POST" else None
    for key in (None, "wrong-key"):
        status, payload = _call(server, path, body, key=key, method=method)
        assert status == 401, (path, key, payload)
        assert KEY not in payload.decode(errors="replace")


def test_with_the_key_moe_and_generation_answer(server):
    status, payload = _call(server, "/v1/moe", key=KEY)
    assert status == 200 and len(json.loads(payload)["layers"]) == 2
    assert KEY not in payload.decode()
    assert _good(server) == server.reference


def test_the_key_is_in_no_log_line(server):
    log = server.log()
    assert "[moe-overlay] starting:" in log and "every route requires the API key" in log
    assert KEY not in log


def test_auto_fallback_is_said_in_v1_moe_and_the_log(server):
    status, payload = _call(server, "/v1/moe", key=KEY)
    layers = json.loads(payload)["layers"]
    assert status == 200 and len(layers) == 2
    for row in layers:
        assert row["backend"] != "aiter" and "aiter" in row["rejected"], row
        assert row["rejected"]["aiter"], row  # the reason AITER cannot run it
    log = server.log()
    assert "[moe-overlay] MixtralForCausalLM: 2 MoE layers" in log
    for row in layers:
        line = next(line for line in log.splitlines() if line.startswith(row["layer"]))
        assert row["backend"] in line.split()
