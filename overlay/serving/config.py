"""Deployment YAML -> vLLM server arguments and environment, validated with clear errors.

One file per deployment is the single surface users edit. Every error names the file,
the key and the value; conflicting or half-set environment switches are refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..patches.plugin import BACKEND_ENV, STRICT_ENV

BACKENDS = ("auto", "torch", "vllm", "aiter", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hf:"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
PLUGINS = ("moe_overlay", "moe_overlay_endpoint")

# section -> key -> (allowed python types, default)
SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "model": {
        "path": ((str,), None),
        "name": ((str,), None),
        "dtype": ((str,), "auto"),
        "max_model_len": ((int,), None),
        "quantization": ((str,), None),
    },
    "moe": {"backend": ((str,), "auto"), "strict": ((bool,), False)},
    "parallel": {"tensor": ((int,), 1), "pipeline": ((int,), 1), "data": ((int,), 1), "expert": ((bool,), False)},
    "server": {"host": ((str,), "127.0.0.1"), "port": ((int,), 8000)},
    "vllm": {},  # free-form: any other `vllm serve` flag
    "env": {},  # free-form: environment variables for the server
}
# vllm flags that a section above owns (setting them twice would be ambiguous) -> (its key
# in the file, the Deployment field that holds its value)
OWNED_FLAGS = {
    "model": ("model.path", "model"), "served-model-name": ("model.name", "name"), "dtype": ("model.dtype", "dtype"),
    "max-model-len": ("model.max_model_len", "max_model_len"), "quantization": ("model.quantization", "quantization"),
    "host": ("server.host", "host"), "port": ("server.port", "port"),
    "tensor-parallel-size": ("parallel.tensor", "tensor"), "pipeline-parallel-size": ("parallel.pipeline", "pipeline"),
    "data-parallel-size": ("parallel.data", "data"), "enable-expert-parallel": ("parallel.expert", "expert"),
}
AITER_MASTER = "VLLM_ROCM_USE_AITER"
AITER_MOE = "VLLM_ROCM_USE_AITER_MOE"


class ConfigError(ValueError):
    """A deployment file that cannot be served as written (message names file, key, value)."""


@dataclass
class Deployment:
    source: Path
    model: str  # what vLLM is given: a local folder or a hub id
    builtin: str | None  # embedded model to build first, if any
    name: str
    dtype: str
    max_model_len: int | None
    quantization: str | None
    backend: str
    strict: bool
    tensor: int
    pipeline: int
    data: int
    expert: bool
    host: str
    port: int
    extra_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, python: str) -> list[str]:
        args = [python, "-m", SERVER_MODULE]
        for flag, (_, attribute) in OWNED_FLAGS.items():
            value = getattr(self, attribute)
            if value is True:  # a switch
                args.append(f"--{flag}")
            elif value is not None and value is not False:
                args += [f"--{flag}", str(value)]
        return args + self.extra_flags

    def environment(self, state_dir: Path) -> dict[str, str]:
        """What the server process gets on top of the caller's environment."""
        env = {BACKEND_ENV: self.backend, STRICT_ENV: "1" if self.strict else "0",
               "VLLM_PLUGINS": ",".join(PLUGINS), "VLLM_CACHE_ROOT": str(state_dir / "cache" / "vllm")}
        env.update(self.env)
        return env


def _fail(source: Path, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {problem}")


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join({str: "a string", int: "an integer", bool: "true or false"}[t] for t in types)


def _section(source: Path, raw: dict, name: str) -> dict[str, Any]:
    value = raw.get(name) or {}
    if not isinstance(value, dict):
        raise _fail(source, name, f"must be a mapping, got {value!r}")
    schema = SCHEMA[name]
    if schema:
        for key in value:
            if key not in schema:
                raise _fail(source, f"{name}.{key}", f"unknown key (known: {', '.join(schema)})")
    out = {k: default for k, (_, default) in schema.items()}
    for key, item in value.items():
        if schema and item is not None:
            types = schema[key][0]
            if not isinstance(item, types) or (isinstance(item, bool) and bool not in types):
                raise _fail(source, f"{name}.{key}", f"must be {_type_name(types)}, got {item!r}")
        out[key] = item
    return out


def _flag_args(source: Path, flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        flag = str(key).lstrip("-").replace("_", "-")
        if flag in OWNED_FLAGS:
            raise _fail(source, f"vllm.{key}", f"set it as {OWNED_FLAGS[flag][0]} instead")
        if value is True:
            args.append(f"--{flag}")
        elif value is False:
            args.append(f"--no-{flag}")
        elif isinstance(value, list):
            args += [f"--{flag}", *map(str, value)]
        elif isinstance(value, dict):
            args += [f"--{flag}", json.dumps(value)]
        elif value is None:
            raise _fail(source, f"vllm.{key}", "has no value (use true, a value, or remove it)")
        else:
            args += [f"--{flag}", str(value)]
    return args


def _env(source: Path, raw: dict[str, Any], backend: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for name, value in raw.items():
        key = str(name)
        if not isinstance(value, str | int | float | bool):
            raise _fail(source, f"env.{key}", f"must be a string or number, got {value!r}")
        env[key] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        if key.startswith("MOE_OVERLAY_"):
            raise _fail(source, f"env.{key}", "is set by moe-overlay itself: use the moe: section")
        if key == "VLLM_PLUGINS":
            raise _fail(source, f"env.{key}", f"is set by moe-overlay to {','.join(PLUGINS)}")
    aiter_switches = [k for k, v in env.items() if k.startswith(AITER_MASTER + "_") and v not in ("0", "false")]
    if aiter_switches and env.get(AITER_MASTER) not in ("1", "true"):
        raise _fail(source, f"env.{aiter_switches[0]}",
                    f"has no effect unless {AITER_MASTER}=1 is set too (half-set switches are refused)")
    if env.get(AITER_MOE) in ("1", "true") and backend != "vllm":
        raise _fail(source, f"env.{AITER_MOE}",
                    f"conflicts with moe.backend={backend}: moe.backend picks the MoE kernel "
                    f"(use moe.backend: aiter, or moe.backend: vllm to keep vLLM's own AITER path)")
    return env


def _model(source: Path, path: str | None) -> tuple[str, str | None]:
    if not path:
        raise _fail(source, "model.path", "is required (a local folder, hf:ORG/NAME, or builtin:NAME)")
    if path.startswith(BUILTIN_PREFIX):
        from .builtin_models import BUILTIN_NAMES, builtin_dir

        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_NAMES:
            have = ", ".join(BUILTIN_NAMES)
            raise _fail(source, "model.path", f"{path!r}: no embedded model {name!r} (have: {have})")
        return str(builtin_dir(name)), name
    if path.startswith(HUB_PREFIX):
        return path[len(HUB_PREFIX):], None
    local = Path(os.path.expanduser(path))
    if not local.is_absolute():
        local = (source.parent / local).resolve()
    if not local.is_dir():
        raise _fail(source, "model.path", f"{path!r}: {local} does not exist (use hf:ORG/NAME for a hub model)")
    return str(local), None


def load(path: str | os.PathLike[str]) -> Deployment:
    """Read and validate one deployment file."""
    import yaml

    source = Path(path)
    if not source.is_file():
        raise ConfigError(f"{source}: config file not found")
    try:
        raw = yaml.safe_load(source.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: YAML syntax error: {where}{getattr(err, 'problem', err)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a mapping of sections ({', '.join(SCHEMA)}), got {type(raw).__name__}")
    for key in raw:
        if key not in SCHEMA:
            raise _fail(source, str(key), f"unknown section (known: {', '.join(SCHEMA)})")
    model, moe, par, server = (_section(source, raw, s) for s in ("model", "moe", "parallel", "server"))
    if model["dtype"] not in DTYPES:
        raise _fail(source, "model.dtype", f"{model['dtype']!r} is not one of {', '.join(DTYPES)}")
    if moe["backend"] not in BACKENDS:
        raise _fail(source, "moe.backend", f"{moe['backend']!r} is not one of {', '.join(BACKENDS)}")
    for key in ("tensor", "pipeline", "data"):
        if par[key] < 1:
            raise _fail(source, f"parallel.{key}", f"must be at least 1, got {par[key]}")
    if not 0 < server["port"] < 65536:
        raise _fail(source, "server.port", f"{server['port']} is not a TCP port")
    model_arg, builtin = _model(source, model["path"])
    return Deployment(
        source=source, model=model_arg, builtin=builtin,
        name=model["name"] or (builtin or Path(model_arg).name), dtype=model["dtype"],
        max_model_len=model["max_model_len"], quantization=model["quantization"],
        backend=moe["backend"], strict=moe["strict"], tensor=par["tensor"], pipeline=par["pipeline"],
        data=par["data"], expert=par["expert"], host=server["host"], port=server["port"],
        extra_flags=_flag_args(source, _section(source, raw, "vllm")),
        env=_env(source, _section(source, raw, "env"), moe["backend"]),
    )
