"""Deployment YAML validation and `moe-overlay serve` bad input: one clear line, non-zero exit."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe_overlay.serving.config import ConfigError, gsm8k_gate, load

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-mixtral.yaml"


def _write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _variant(tmp_path: Path, **sections) -> Path:
    raw = yaml.safe_load(TINY.read_text())
    for section, values in sections.items():
        if values is None:
            raw.pop(section, None)
        elif not isinstance(values, dict):
            raw[section] = values
        else:
            raw.setdefault(section, {}).update(values)
    return _write(tmp_path, yaml.safe_dump(raw))


def _serve(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_overlay.cli", "serve", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("moe-overlay serve: error: ")
    return lines[0]


def test_tiny_config_resolves(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_OVERLAY_VAR", str(tmp_path / "var"))
    dep = load(TINY)
    assert dep.builtin == "tiny-mixtral" and dep.model == str(tmp_path / "var" / "models" / "tiny-mixtral")
    argv = dep.argv("python")
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--enforce-eager" in argv
    env = dep.environment(tmp_path / "var")
    assert env["MOE_OVERLAY_BACKEND"] == "torch" and env["MOE_OVERLAY_STRICT"] == "1"
    assert env["VLLM_PLUGINS"] == "moe_overlay,moe_overlay_endpoint" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize(
    "sections,message",
    [
        ({"moe": {"backend": "cuda"}}, r"moe\.backend: 'cuda' is not one of auto, torch, vllm, aiter, triton"),
        ({"moe": {"strict": "yes"}}, r"moe\.strict: must be true or false, got 'yes'"),
        ({"parallel": {"tensor": 0}}, r"parallel\.tensor: must be at least 1, got 0"),
        ({"parallel": {"gpus": 2}}, r"parallel\.gpus: unknown key \(known: tensor, pipeline, data, expert\)"),
        ({"server": {"port": 70000}}, r"server\.port: 70000 is not a TCP port"),
        ({"model": {"dtype": "fp8"}}, r"model\.dtype: 'fp8' is not one of"),
        ({"model": {"path": "builtin:huge"}}, r"model\.path: 'builtin:huge': no embedded model 'huge'"),
        ({"model": {"path": None}}, r"model\.path: is required"),
        ({"vllm": {"port": 9}}, r"vllm\.port: set it as server\.port instead"),
        ({"vllm": {"tensor_parallel_size": 2}}, r"vllm\.tensor_parallel_size: set it as parallel\.tensor instead"),
        ({"env": {"MOE_OVERLAY_BACKEND": "vllm"}}, r"env\.MOE_OVERLAY_BACKEND: is set by moe-overlay itself"),
        ({"env": {"VLLM_ROCM_USE_AITER_MOE": 1}},
         r"env\.VLLM_ROCM_USE_AITER_MOE: has no effect unless VLLM_ROCM_USE_AITER=1 is set too"),
        ({"env": {"VLLM_ROCM_USE_AITER": 1, "VLLM_ROCM_USE_AITER_MOE": 1}},
         r"env\.VLLM_ROCM_USE_AITER_MOE: conflicts with moe\.backend=torch"),
        ({"env": {"VLLM_ROCM_USE_AITER": 1, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": 1}},
         r"env\.VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS: makes AITER run the shared experts as routed ones "
         r"\(DeepSeek-V3: 257 local experts for the checkpoint's 256\), which moe\.backend=torch does not model"),
        ({"env": {"VLLM_PLUGINS": "x"}}, r"env\.VLLM_PLUGINS: is set by moe-overlay"),
        ({"env": {"A": [1]}}, r"env\.A: must be a string or number, got \[1\]"),
        ({"accuracy": {"gsm8k": 0.9}}, r"accuracy: unknown section \(known: model, moe, parallel, server, nodes, "),
        ({"model": {"max_model_len": "4k"}}, r"model\.max_model_len: must be an integer, got '4k'"),
        ({"parallel": {"tensor": True}}, r"parallel\.tensor: must be an integer, got True"),
        ({"server": "localhost"}, r"server: must be a mapping, got 'localhost'"),
        ({"nodes": {"count": 2}}, r"nodes\.head_address: is required with nodes\.count: 2"),
        ({"nodes": {"count": 2, "head_address": "10.0.0.1"}, "parallel": {"data": 3}},
         r"nodes\.count: 2 does not divide parallel\.data \(3\)"),
        ({"nodes": {"rpc_port": 0}}, r"nodes\.rpc_port: 0 is not a TCP port"),
        ({"vllm": {"headless": True}}, r"vllm\.headless: is set per node from the nodes: section"),
        ({"hardware": {"gpus": "8x MI300X", "arch": "gfx90a"}},
         r"hardware\.arch: 'gfx90a' is not one of gfx942, gfx950"),
        ({"hardware": {"notes": 5}}, r"hardware\.notes: must be a string, got 5"),
        ({"hardware": {"gpus": "8x MI300X", "arch": "gfx942", "hbm": 192}},
         r"hardware\.hbm: unknown key \(known: gpus, arch, notes\)"),
        ({"gsm8k": {"published": 95.5, "source": "x"}}, r"gsm8k\.published: must be less than 1\.0, got 95\.5"),
        ({"gsm8k": {"published": 0.9}}, r"gsm8k\.source: is required"),
        ({"speculative_config": {"method": "medusa2", "num_speculative_tokens": 1}},
         r"speculative_config\.method: 'medusa2' is not one of mtp, deepseek_mtp, kimi_k3_mtp, eagle, eagle3, "),
        ({"speculative_config": {"method": "mtp"}}, r"speculative_config\.num_speculative_tokens: is required"),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 0}},
         r"speculative_config\.num_speculative_tokens: must be at least 1, got 0"),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1, "tokens": 2}},
         r"speculative_config\.tokens: unknown key \(known: method, num_speculative_tokens, model, "
         r"draft_tensor_parallel_size\)"),
        ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3}},
         r"speculative_config\.model: is required with method eagle3 \(the draft model's checkpoint\)"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "model": "hf:a/b"}},
         r"speculative_config\.model: 'hf:a/b': method ngram runs no draft model"),
        ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3, "model": "drafts/none"}},
         r"speculative_config\.model: 'drafts/none': .*drafts/none does not exist"),
        ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3, "model": "builtin:tiny-mixtral"}},
         r"speculative_config\.model: 'builtin:tiny-mixtral': no embedded draft models"),
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 4},
          "parallel": {"tensor": 8}},
         r"speculative_config\.draft_tensor_parallel_size: 4: vLLM takes 1 or the target's parallel\.tensor \(8\)"),
        ({"vllm": {"speculative-config": {"method": "mtp"}}},
         r"vllm\.speculative-config: set it as speculative_config instead"),
    ],
)
def test_bad_config_names_file_key_and_value(tmp_path, sections, message):
    path = _variant(tmp_path, **sections)
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        load(path)


def test_empty_sections_are_empty(tmp_path):
    path = _write(tmp_path, "model:\n  path: builtin:tiny-mixtral\nmoe:\nvllm:\n")
    dep = load(path)
    assert dep.backend == "auto" and dep.extra_flags == [] and dep.tensor == 1


def test_gsm8k_gate_is_published_less_three_standard_errors():
    # p = 0.5 on 1,319 questions: standard error sqrt(0.25 / 1319) = 0.013767
    assert gsm8k_gate(0.5) == pytest.approx(0.5 - 3 * 0.013767, abs=1e-6)
    assert gsm8k_gate(0.9553) == pytest.approx(0.93823, abs=1e-5)
    assert gsm8k_gate(0.9553, questions=100) < gsm8k_gate(0.9553)  # fewer questions, wider


def test_vllm_backend_keeps_upstream_aiter_switches(tmp_path):
    env = {"VLLM_ROCM_USE_AITER": 1, "VLLM_ROCM_USE_AITER_MOE": 1, "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": 1}
    dep = load(_variant(tmp_path, moe={"backend": "vllm"}, env=env))
    assert dep.env["VLLM_ROCM_USE_AITER_MOE"] == dep.env["VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"] == "1"


def test_flags_and_relative_model_paths(tmp_path):
    (tmp_path / "weights").mkdir()
    path = _variant(tmp_path, model={"path": "weights", "name": None}, vllm={"enable_prefix_caching": False, "seed": 3})
    dep = load(path)
    assert dep.model == str(tmp_path / "weights") and dep.name == "weights"
    flags = dep.extra_flags
    assert "--no-enable-prefix-caching" in flags and flags[flags.index("--seed") + 1] == "3"


def test_speculative_config_becomes_vllms_flag(tmp_path):
    """The section is vLLM's --speculative-config JSON on every node; a local draft path is resolved
    against the file's folder and a hub draft loses its hf: prefix, as model.path does."""
    (tmp_path / "draft").mkdir()
    local = load(_variant(tmp_path, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                                         "model": "draft", "draft_tensor_parallel_size": 1}))
    argv = local.argv("python")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3", "num_speculative_tokens": 3, "model": str(tmp_path / "draft"),
        "draft_tensor_parallel_size": 1}
    hub = load(_variant(tmp_path, speculative_config={"method": "eagle3", "num_speculative_tokens": 2,
                                                       "model": "hf:org/draft"}))
    assert json.loads(hub.speculative) == {"method": "eagle3", "num_speculative_tokens": 2, "model": "org/draft"}
    assert "--speculative-config" not in load(TINY).argv("python")


def test_dry_run_of_the_mtp_config(tmp_path):
    result = _serve(str(ROOT / "configs" / "tiny-deepseek-v3-mtp.yaml"), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert """--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'""" in result.stdout


def test_exported_recipe_keeps_the_speculative_config():
    from moe_overlay.serving.recipe import recipe

    args = recipe(load(ROOT / "configs" / "deepseek-v3-mi300x-tp8-mtp.yaml"), "0.32.0")["model"]["base_args"]
    assert json.loads(args[args.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 1}


def test_dry_run_prints_the_resolved_command(tmp_path):
    result = _serve(str(TINY), "--dry-run", "--port", "8123", "--backend", "vllm", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "MOE_OVERLAY_BACKEND=vllm" in result.stdout and "--port 8123" in result.stdout
    assert "vllm.entrypoints.launchers.api_server.entry" in result.stdout
    assert not (tmp_path / "var").exists()  # a dry run builds nothing


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda d: str(d / "missing.yaml"), r"missing\.yaml: config file not found"),
        (lambda d: str(_write(d, "model:\n  path: [unclosed\n")), r"deploy\.yaml: YAML syntax error: line \d+"),
        (lambda d: str(_write(d, "model:\n  path: builtin:tiny-mixtral\nmodle: {}\n")),
         r"deploy\.yaml: modle: unknown section"),
        (lambda d: str(_write(d, "model:\n  path: /nonexistent/weights\n")),
         r"model\.path: '/nonexistent/weights': /nonexistent/weights does not exist"),
    ],
)
def test_serve_bad_input_is_one_line(tmp_path, make, expected):
    line = _one_error_line(_serve(make(tmp_path), cwd=tmp_path))
    assert re.search(expected, line), line


def test_serve_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _one_error_line(_serve(str(TINY), "--port", str(port), cwd=tmp_path))
    assert f"cannot listen on 127.0.0.1:{port}" in line


TWO_NODES = ROOT / "configs" / "kimi-k3-mi300x-2node-ep16.yaml"


def test_dry_run_shows_every_node_of_a_two_node_deployment(tmp_path):
    result = _serve(str(TWO_NODES), "--dry-run", "--head-address", "192.0.2.7", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    comments = [line for line in result.stdout.splitlines() if line.startswith("#")]
    commands = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    assert comments == [f"# node 0 (head): moe-overlay serve {TWO_NODES} --role head --node-rank 0",
                        f"# node 1 (worker): moe-overlay serve {TWO_NODES} --role worker --node-rank 1"]
    head, worker = commands
    assert "vllm.entrypoints.cli.main serve --model moonshotai/Kimi-K3" in head
    for command in (head, worker):
        assert "--data-parallel-size 2 " in command and "--data-parallel-size-local 1 " in command
        assert "--data-parallel-address 192.0.2.7 " in command and "--tensor-parallel-size 8 " in command
    assert "--headless" not in head and "--port 8000" in head
    assert "--headless --data-parallel-start-rank 1" in worker and "--port" not in worker


def test_dry_run_of_one_node(tmp_path):
    result = _serve(str(TWO_NODES), "--dry-run", "--role", "worker", "--node-rank", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--headless") == 1 and result.stdout.startswith("# node 1 (worker)")


@pytest.mark.parametrize(
    "config,args,expected",
    [
        (TWO_NODES, ("--role", "worker", "--node-rank", "0"), r"--role worker is --node-rank 1\.\.1 \(got worker 0\)"),
        (TWO_NODES, ("--node-rank", "2"), r"nodes\.count: 2 nodes"),
        (TINY, ("--role", "worker"), r"nodes\.count: is 1, so there is only --role head --node-rank 0"),
    ],
)
def test_bad_role_is_one_line(tmp_path, config, args, expected):
    line = _one_error_line(_serve(str(config), "--dry-run", *args, cwd=tmp_path))
    assert re.search(expected, line), line
