"""Every shipped deployment resolves, for every node, into a command line that the installed
vLLM's own `vllm serve` parser accepts; `config check` and `config export-recipe` end to end."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import vllm
import yaml

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.config import ConfigError, load
from moe_overlay.serving.recipe import STRATEGIES, dump, recipe
from moe_overlay.serving.vllm_args import check_deployment, check_flags, server_flags
from tests.lanes import CONFIGS, ROOT, assert_config_check, config_check

REAL = [c for c in CONFIGS if not c.name.startswith("tiny-")]
NODES = [(c, n.role, n.rank) for c in CONFIGS for n in load(c).all_nodes()]


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_overlay.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_the_issue_deployments_are_shipped():
    names = {c.stem for c in REAL}
    assert {"kimi-k3-mi355x-tp8", "kimi-k3-mi325x-tp8", "kimi-k3-mi300x-2node-ep16", "deepseek-v3-mi300x-tp8",
            "deepseek-v3-mi300x-tp8-ep8", "llama4-maverick-bf16-mi300x-tp8", "llama4-maverick-fp8-mi300x-tp8",
            "mixtral-8x7b-instruct-bf16-mi300x", "mixtral-8x7b-instruct-fp8-mi300x"} <= names
    for config in REAL:
        dep = load(config)
        assert dep.hardware is not None and dep.gsm8k is not None and dep.strict, config
    published = {"kimi-k3": 0.9553, "deepseek-v3": 0.9454, "llama4-maverick-bf16": 0.9272,
                 "llama4-maverick-fp8": 0.9234, "mixtral-8x7b-instruct": 0.5413}  # the issue's figures
    for config in REAL:
        figure = next(v for k, v in published.items() if config.stem.startswith(k))
        assert load(config).gsm8k.published == figure, config
    assert load(ROOT / "configs" / "kimi-k3-mi355x-tp8.yaml").backend == "aiter"  # gfx950: AITER's mxfp4
    assert load(ROOT / "configs" / "kimi-k3-mi325x-tp8.yaml").backend == "triton"  # gfx942: no AITER mxfp4


@pytest.mark.parametrize("config,role,rank", NODES, ids=[f"{c.stem}-{r}{n}" for c, r, n in NODES])
def test_every_node_parses_with_vllms_own_parser(config, role, rank):
    dep = load(config)
    argv = dep.argv("python", dep.node(role, rank))
    check_flags(server_flags(argv))  # raises with vLLM's message on any flag or value it refuses


def test_a_flag_vllm_does_not_know_is_refused_with_its_message(tmp_path):
    raw = yaml.safe_load((ROOT / "configs" / "deepseek-v3-mi300x-tp8.yaml").read_text())
    raw["vllm"]["kv-cache-dtype"] = "fp7"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"^{path}: node 0 \(head\): vLLM refuses the command line: .*"
                                          r"--kv-cache-dtype: invalid choice: 'fp7'"):
        check_deployment(load(path))


@pytest.mark.parametrize(
    "env,message",
    [
        ({"VLLM_ROCM_USE_AITR": 1}, r"env\.VLLM_ROCM_USE_AITR: the installed vLLM reads no such environment variable"),
        ({"VLLM_ROCM_USE_AITER_MOE_SITUV2": "a2w2"}, r"env\.VLLM_ROCM_USE_AITER_MOE_SITUV2=a2w2: Invalid value 'a2w2'"),
    ],
)
def test_an_environment_variable_vllm_does_not_read_is_refused(tmp_path, env, message):
    raw = yaml.safe_load((ROOT / "configs" / "kimi-k3-mi355x-tp8.yaml").read_text())
    raw["env"].update(env)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"^{path}: {message}"):
        check_deployment(load(path))


def test_config_check_command(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: hf:org/x\nparallel:\n  gpus: 8\n")
    result = _cli("config", "check", "--no-vllm", str(ROOT / "configs" / "tiny-mixtral.yaml"), str(bad))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ok   ") and lines[1] == f"FAIL {bad}: parallel.gpus: unknown key " \
                                                         "(known: tensor, pipeline, data, expert)"
    result = config_check(None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_config_check(result.stdout, CONFIGS, vllm.__version__)


def test_config_check_says_when_it_cannot_build_the_stand_in(monkeypatch):
    monkeypatch.setenv("MOE_OVERLAY_VAR", "/proc/no-such-state-dir")  # as in an image whose folder is read-only
    result = _cli("config", "check", str(ROOT / "configs" / "kimi-k3-mi355x-tp8.yaml"))
    assert result.returncode == 0 and "; MoE quant method not checked: [Errno 2] No such file or directory: " \
        "'/proc/no-such-state-dir'" in result.stdout, result.stdout


def test_config_check_fails_a_strict_deployment_whose_moe_quant_method_is_not_mapped(tmp_path):
    """fp8 with static activation scales (quantization_config in the checkpoint's config.json): strict
    refuses it at start-up, and config check says so first, naming upstream's method and why."""
    checkpoint = tmp_path / "static-fp8"
    checkpoint.mkdir()
    config = json.loads((ensure_builtin("tiny-mixtral") / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (checkpoint / "config.json").write_text(json.dumps(config))
    deployment = tmp_path / "static.yaml"
    deployment.write_text(f"model: {{path: {checkpoint}, dtype: bfloat16}}\nmoe: {{backend: torch, strict: true}}\n")
    result = _cli("config", "check", str(deployment))
    assert result.returncode == 1
    assert result.stdout.splitlines()[-1] == (
        f"FAIL {deployment}: moe.backend: torch with moe.strict stops at start-up: vLLM {vllm.__version__} gives the "
        f"MoE layers of {checkpoint}: Fp8MoEMethod, not mapped: fp8 per-tensor with static activation scales "
        "(activation_scheme 'static') is not modelled by the adapter (it quantises activations dynamically)")


@pytest.mark.parametrize("config", REAL, ids=[c.stem for c in REAL])
def test_recipe_export(config):
    dep = load(config)
    exported = yaml.safe_load(dump(recipe(dep, "0.32.0")))
    assert list(exported) == ["meta", "model", "dependencies", "variants", "compatible_strategies",
                              "hardware_overrides", "guide"]
    assert exported["model"]["model_id"] == dep.model and exported["meta"]["slug"] == config.stem
    assert exported["compatible_strategies"][0] in STRATEGIES.values()
    assert exported["hardware_overrides"]["amd"]["extra_env"]["MOE_OVERLAY_BACKEND"] == dep.backend
    commands = [line for line in exported["guide"].splitlines() if " vllm serve " in line]
    assert len(commands) == dep.nodes.count
    for command in commands:
        words = shlex.split(command)
        check_flags(words[words.index("serve") + 1:])  # the guide's commands are valid `vllm serve` lines


def test_export_recipe_command_refuses_an_embedded_model():
    result = _cli("config", "export-recipe", str(ROOT / "configs" / "tiny-mixtral.yaml"))
    assert result.returncode == 2 and "an embedded model has no hub id" in result.stderr
