"""A deployment in the form of vLLM's recipes repository (one YAML per model: meta, model,
dependencies, variants, compatible_strategies, hardware_overrides, guide), so it can be handed on.

The overlay's switches go where that format keeps AMD specifics (`hardware_overrides.amd`); the
parallel layout becomes the matching strategy id; the guide carries the exact per-node commands."""

from __future__ import annotations

import datetime
import shlex
from typing import Any

from .config import ConfigError, Deployment, Node

# (nodes > 1, tensor > 1, expert, data > 1) -> the recipes repository's strategy id
STRATEGIES = {
    (False, True, False, False): "single_node_tp", (False, False, False, False): "single_node_tp",
    (False, True, True, False): "single_node_tep", (False, False, True, True): "single_node_dep",
    (False, True, True, True): "single_node_dep",
    (True, True, False, True): "multi_node_tp_dp", (True, True, True, True): "multi_node_tp_dp",
    (True, False, True, True): "multi_node_dep",
}
PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
OVERLAY_INSTALL = "pip install --no-deps ./moe-overlay  # from a moe-overlay checkout"


def _strategy(dep: Deployment) -> str:
    key = (dep.nodes.count > 1, dep.tensor > 1, dep.expert, dep.data > 1)
    if key not in STRATEGIES or dep.pipeline > 1:
        raise ConfigError(f"{dep.source}: parallel: no strategy of vLLM's recipes repository matches "
                          f"tensor {dep.tensor}, pipeline {dep.pipeline}, data {dep.data}, expert {dep.expert}, "
                          f"{dep.nodes.count} node(s)")
    return STRATEGIES[key]


def _vllm_serve(dep: Deployment, node: Node, env: dict[str, str]) -> str:
    from .vllm_args import server_flags

    flags = server_flags(dep.argv("python", node))
    model = flags.index("--model")
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return f"{assignments} vllm serve {shlex.quote(flags[model + 1])} {shlex.join(flags[:model] + flags[model + 2:])}"


def _guide(dep: Deployment, env: dict[str, str]) -> str:
    hardware = dep.hardware.gpus if dep.hardware else "see the deployment file"
    lines = ["## Overview",
             f"MoE layers on moe-overlay's `{dep.backend}` backend"
             f"{' (strict: no fallback)' if dep.strict else ''}, plugged into an unmodified vLLM.",
             "", "## Prerequisites", f"- **Hardware**: {hardware}", f"- moe-overlay installed: `{OVERLAY_INSTALL}`",
             "", "## Launching the Server"]
    for node in dep.all_nodes():
        if dep.nodes.count > 1:
            lines.append(f"Node {node.rank} ({node.role}):")
        lines += ["```bash", _vllm_serve(dep, node, env), "```"]
    if dep.gsm8k:
        lines += ["", "## Accuracy", f"lm-eval gsm8k, 5-shot, flexible-extract: published {dep.gsm8k.published} "
                  f"({dep.gsm8k.source}); `moe-overlay eval gsm8k` gates at {dep.gate:.4f}."]
    return "\n".join(lines) + "\n"


def recipe(dep: Deployment, vllm_version: str, today: datetime.date | None = None) -> dict[str, Any]:
    if dep.builtin:
        raise ConfigError(f"{dep.source}: model.path: an embedded model has no hub id to publish a recipe for")
    today = today or datetime.date.today()
    env = dep.overlay_env()
    org, _, repo = dep.model.partition("/")
    flags = []
    for flag, value in (("--max-model-len", dep.max_model_len), ("--quantization", dep.quantization),
                        ("--dtype", None if dep.dtype == "auto" else dep.dtype),
                        ("--speculative-config", dep.speculative)):
        if value is not None:
            flags += [flag, str(value)]
    precision = dep.precision or dep.quantization or PRECISIONS.get(dep.dtype)
    if precision is None:
        raise ConfigError(f"{dep.source}: model.precision: is required to export a recipe (bf16, fp8, mxfp4...)")
    return {
        "meta": {"title": f"{repo} ({dep.source.stem})", "slug": dep.source.stem, "provider": org,
                 "description": f"{repo} with moe-overlay's {dep.backend} MoE backend"
                                + (f" on {dep.hardware.gpus}" if dep.hardware else ""),
                 "date_added": today, "date_updated": today,
                 "difficulty": "advanced" if dep.nodes.count > 1 else "intermediate", "tasks": ["text"]},
        "model": {"model_id": dep.model, "min_vllm_version": vllm_version.split("+")[0], "architecture": "moe",
                  "base_args": flags + dep.extra_flags, "base_env": {}},
        "dependencies": [{"note": "moe-overlay, the prepared-MoE adapter vLLM loads as a plugin",
                          "command": OVERLAY_INSTALL}],
        "variants": {"default": {"precision": precision, "description": f"{precision} weights"}},
        "compatible_strategies": [_strategy(dep)],
        "hardware_overrides": {"amd": {"extra_args": [], "extra_env": env}},
        "guide": _guide(dep, env),
    }


def dump(data: dict[str, Any]) -> str:
    """YAML as that repository writes it: dates bare, the guide a literal block, no anchors."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, width=1000, allow_unicode=True)

