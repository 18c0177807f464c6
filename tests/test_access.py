"""Access and safe defaults without a server: the bind address, the API key's way from the config
or the environment into the server (never onto a command line), the every-route guard, safe
YAML, trust-remote-code only on request. The served checks are in tests/test_served_requests.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from moe_overlay.serving import access
from moe_overlay.serving.config import API_KEY_ENV, ConfigError, load

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-mixtral.yaml"
KEY = "sk-test-0f9e8d7c6b5a"


def _config(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    edit(raw)
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _dry_run(config: Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "moe_overlay.cli", "serve", str(config), "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=cwd, env={**os.environ, **(env or {})})


def test_binds_loopback_unless_the_config_says_otherwise(tmp_path):
    unset = _config(tmp_path, lambda raw: raw.pop("server"))
    argv = load(unset).argv("python")
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    wide = _config(tmp_path, lambda raw: raw.update(server={"host": "0.0.0.0"}))
    argv = load(wide).argv("python")
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_api_key_from_the_config_is_never_printed(tmp_path):
    config = _config(tmp_path, lambda raw: raw["server"].update(api_key=KEY))
    deployment = load(config)
    assert deployment.api_key is not None and deployment.api_key.get_secret_value() == KEY
    assert KEY not in repr(deployment) and KEY not in " ".join(deployment.argv("python"))
    assert KEY not in str(deployment.environment(tmp_path))
    result = _dry_run(config, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--host 127.0.0.1" in result.stdout and KEY not in result.stdout + result.stderr


def test_api_key_from_the_environment_is_never_printed(tmp_path):
    result = _dry_run(TINY, tmp_path, {API_KEY_ENV: KEY})
    assert result.returncode == 0, result.stderr
    assert KEY not in result.stdout + result.stderr


@pytest.mark.parametrize("edit, where", [
    (lambda raw: raw["vllm"].update({"api-key": KEY}), "vllm.api-key"),
    (lambda raw: raw["env"].update({API_KEY_ENV: KEY}), f"env.{API_KEY_ENV}"),
])
def test_a_key_where_it_would_be_printed_is_refused(tmp_path, edit, where):
    with pytest.raises(ConfigError, match=f"{where}: .*server.api_key") as err:
        load(_config(tmp_path, edit))
    assert KEY not in str(err.value)


def test_configs_are_read_with_a_safe_loader(tmp_path):
    marker = tmp_path / "executed"
    config = tmp_path / "deploy.yaml"
    config.write_text(TINY.read_text() + f"extra: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="python/object"):
        load(config)
    assert not marker.exists()


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_trust_remote_code_only_where_a_config_asks(config):
    raw = yaml.safe_load(config.read_text())
    asks = bool((raw.get("vllm") or {}).get("trust-remote-code"))
    try:
        argv = load(config).argv("python")
    except ConfigError as err:  # a real deployment's weights are not on this machine
        assert "model.path" in str(err)
        return
    assert ("--trust-remote-code" in argv) == asks


def _guarded_app() -> TestClient:
    async def hello(request):
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route(path, hello, methods=["GET", "POST"]) for path in ("/v1/moe", "/tokenize", "/")])
    app.add_middleware(access.RequireKey, key=KEY)
    return TestClient(app)


@pytest.mark.parametrize("path", ["/v1/moe", "/tokenize", "/"])
def test_the_guard_covers_every_path(path):
    client = _guarded_app()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        response = client.get(path, headers=headers)
        assert response.status_code == 401 and KEY not in response.text
        assert "Authorization: Bearer" in response.json()["error"]
    assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).text == "hello"
    assert client.options(path).status_code != 401  # CORS preflight carries no credentials


def test_no_key_no_guard(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    app = Starlette()
    assert access.install(app) is False and app.user_middleware == []
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert access.install(app) is True and app.user_middleware[0].cls is access.RequireKey


def _model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _config_on(tmp_path: Path, folder: Path) -> Path:
    return _config(tmp_path, lambda raw: raw["model"].update(path=str(folder)))


def test_a_link_out_of_the_model_folder_is_refused_and_named(tmp_path):
    folder = _model_folder(tmp_path)
    elsewhere = tmp_path / "other-model"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"x")
    (folder / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model\.path: .* has links that lead out of it: "
                                          r"model\.safetensors -> .*other-model/model\.safetensors"):
        load(_config_on(tmp_path, folder))


def test_links_inside_the_model_folder_are_fine(tmp_path):
    folder = _model_folder(tmp_path)
    (folder / "shards").mkdir()
    (folder / "shards" / "a.safetensors").write_bytes(b"x")
    (folder / "model.safetensors").symlink_to(folder / "shards" / "a.safetensors")
    assert load(_config_on(tmp_path, folder)).model == str(folder)
