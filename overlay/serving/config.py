"""Deployment YAML -> vLLM server arguments and environment, validated with clear errors.

One file per deployment is the single surface users edit. The file's shape is a pydantic
model (unknown keys refused, no type coercion); every error is one line naming the file, the
key and the value. Conflicting or half-set environment switches are refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..patches.plugin import BACKEND_ENV, STRICT_ENV
from .model_files import describe_links, links_outside

Backend = Literal["auto", "torch", "vllm", "aiter", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)
BUILTIN_PREFIX = "builtin:"
HUB_PREFIX = "hf:"
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"  # one API server, in this process
CLI_MODULE = "vllm.entrypoints.cli.main"  # `vllm serve`: the multi-node launcher (head and --headless)
PLUGINS = ("moe_overlay", "moe_overlay_endpoint")
GSM8K_QUESTIONS = 1319  # GSM8K's test split
GATE_Z = 3.0  # the gate sits this many standard errors of the published figure below it
# vllm flags that a section owns (setting them twice would be ambiguous) -> (its key in the file,
# the Deployment field that holds its value)
OWNED_FLAGS = {
    "model": ("model.path", "model"), "served-model-name": ("model.name", "name"), "dtype": ("model.dtype", "dtype"),
    "max-model-len": ("model.max_model_len", "max_model_len"), "quantization": ("model.quantization", "quantization"),
    "host": ("server.host", "host"), "port": ("server.port", "port"),
    "tensor-parallel-size": ("parallel.tensor", "tensor"), "pipeline-parallel-size": ("parallel.pipeline", "pipeline"),
    "data-parallel-size": ("parallel.data", "data"), "enable-expert-parallel": ("parallel.expert", "expert"),
    "speculative-config": ("speculative_config", "speculative"),
}
NODE_FLAGS = ("data-parallel-size-local", "data-parallel-address", "data-parallel-rpc-port",
              "data-parallel-start-rank", "headless", "nnodes", "node-rank", "master-addr")
AITER_MASTER = "VLLM_ROCM_USE_AITER"
AITER_MOE = "VLLM_ROCM_USE_AITER_MOE"
AITER_FUSED_SHARED = "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"
API_KEY_ENV = "VLLM_API_KEY"  # the server's key: from server.api_key or the caller's environment, never printed


class ConfigError(ValueError):
    """A deployment file that cannot be served as written (message names file, key, value)."""


def _tcp_port(port: int) -> int:
    if not 0 < port < 65536:
        raise PydanticCustomError("tcp_port", "{port} is not a TCP port", {"port": port})
    return port


def _scalar(value: Any) -> Any:
    if not isinstance(value, str | int | float | bool):
        raise PydanticCustomError("scalar", "must be a string or number, got {got}", {"got": repr(value)})
    return value


Port = Annotated[int, AfterValidator(_tcp_port)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelSection(_Section):
    path: str | None = None  # a local folder (relative to the file), hf:ORG/NAME, or builtin:NAME
    name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    quantization: str | None = None
    # the weights' format as vLLM's recipes repository names it (bf16, fp8, mxfp4...), for the
    # docs and `config export-recipe` only: vLLM reads the format from the checkpoint
    precision: str | None = None


class MoESection(_Section):
    backend: Backend = "auto"
    strict: bool = False


class ParallelSection(_Section):
    tensor: Annotated[int, Field(ge=1)] = 1
    pipeline: Annotated[int, Field(ge=1)] = 1
    data: Annotated[int, Field(ge=1)] = 1
    expert: bool = False


class ServerSection(_Section):
    host: str = "127.0.0.1"
    port: Port = 8000
    api_key: SecretStr | None = None  # required on every route (or export VLLM_API_KEY)


class NodesSection(_Section):
    """Several nodes through vLLM's data-parallel launcher: node 0 (head) runs the API server and
    its share of the data-parallel ranks, every other node (worker) runs `--headless` with its own."""

    count: Annotated[int, Field(ge=1)] = 1
    head_address: str | None = None  # the head node's address every node can reach
    rpc_port: Port = 13345  # vLLM's data-parallel RPC port, the same on every node


# vLLM's speculative methods a deployment of these models can name: `mtp` runs the checkpoint's own
# multi-token-prediction layers as the draft (`deepseek_mtp` and `kimi_k3_mtp` are upstream's older
# names for it, which vLLM rewrites to mtp); the others run a separate draft model, or none.
SpeculativeMethod = Literal["mtp", "deepseek_mtp", "kimi_k3_mtp", "eagle", "eagle3", "dspark", "draft_model",
                            "ngram", "suffix"]
DRAFT_MODEL_METHODS = ("eagle", "eagle3", "draft_model")  # a separate draft checkpoint: `model` is required
MODEL_FREE_METHODS = ("ngram", "suffix")  # no draft model at all


class SpeculativeSection(_Section):
    """vLLM's speculative decoding (`--speculative-config`), its keys as vLLM names them."""

    method: SpeculativeMethod
    num_speculative_tokens: Annotated[int, Field(ge=1)]
    model: str | None = None  # the draft: a local folder (relative to the file) or hf:ORG/NAME
    draft_tensor_parallel_size: Annotated[int, Field(ge=1)] | None = None


class HardwareSection(_Section):
    gpus: str  # e.g. "8x AMD Instinct MI355X"
    arch: Literal["gfx942", "gfx950", "cpu"]
    notes: str = ""


class Gsm8kSection(_Section):
    """lm-eval gsm8k, 5-shot, flexible-extract: the figure published for this model."""

    published: Annotated[float, Field(gt=0, lt=1)]
    source: str


class DeploymentFile(_Section):
    model: ModelSection = ModelSection()
    moe: MoESection = MoESection()
    parallel: ParallelSection = ParallelSection()
    server: ServerSection = ServerSection()
    nodes: NodesSection = NodesSection()
    hardware: HardwareSection | None = None
    gsm8k: Gsm8kSection | None = None
    speculative_config: SpeculativeSection | None = None
    vllm: dict[str, Any] = {}  # free-form: any other `vllm serve` flag
    env: dict[str, Annotated[Any, AfterValidator(_scalar)]] = {}  # environment of the server

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, raw: Any) -> Any:
        """`section:` with nothing under it is an empty section, as YAML users expect."""
        if isinstance(raw, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in raw.items()}
        return raw


SECTIONS = tuple(DeploymentFile.model_fields)


def gsm8k_gate(published: float, questions: int = GSM8K_QUESTIONS, z: float = GATE_Z) -> float:
    """The lowest passing score: the published figure less z standard errors of a score on `questions`."""
    return published - z * math.sqrt(published * (1 - published) / questions)


@dataclass
class Node:
    """One node's part of a deployment: what `serve --role ROLE --node-rank N` runs."""

    role: Literal["head", "worker"]
    rank: int
    flags: list[str]


@dataclass
class Deployment:
    source: Path
    model: str  # what vLLM is given: a local folder or a hub id
    builtin: str | None  # embedded model to build first, if any
    name: str
    dtype: str
    max_model_len: int | None
    quantization: str | None
    precision: str | None
    backend: str
    strict: bool
    tensor: int
    pipeline: int
    data: int
    expert: bool
    host: str
    port: int
    api_key: SecretStr | None = None
    nodes: NodesSection = field(default_factory=NodesSection)
    hardware: HardwareSection | None = None
    gsm8k: Gsm8kSection | None = None
    speculative: str | None = None  # --speculative-config, as JSON
    extra_flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def gate(self) -> float | None:
        return None if self.gsm8k is None else gsm8k_gate(self.gsm8k.published)

    def node(self, role: str = "head", rank: int = 0) -> Node:
        """This node's data-parallel launcher flags (none for a one-node deployment)."""
        count = self.nodes.count
        if count == 1:
            if role != "head" or rank != 0:
                raise ConfigError(f"{self.source}: nodes.count: is 1, so there is only --role head --node-rank 0")
            return Node("head", 0, [])
        if not 0 <= rank < count or (rank == 0) != (role == "head"):
            raise ConfigError(f"{self.source}: nodes.count: {count} nodes: --role head is --node-rank 0, "
                              f"--role worker is --node-rank 1..{count - 1} (got {role} {rank})")
        local = self.data // count
        flags = ["--data-parallel-size-local", str(local), "--data-parallel-address", str(self.nodes.head_address),
                 "--data-parallel-rpc-port", str(self.nodes.rpc_port)]
        if rank:
            return Node("worker", rank, [*flags, "--headless", "--data-parallel-start-rank", str(rank * local)])
        return Node("head", rank, flags)

    def all_nodes(self) -> list[Node]:
        return [self.node("head" if rank == 0 else "worker", rank) for rank in range(self.nodes.count)]

    def argv(self, python: str, node: Node | None = None) -> list[str]:
        node = node or self.node()
        launcher = [SERVER_MODULE] if self.nodes.count == 1 else [CLI_MODULE, "serve"]
        args = [python, "-m", *launcher]
        for flag, (_, attribute) in OWNED_FLAGS.items():
            value = getattr(self, attribute)
            if node.role == "worker" and flag in ("host", "port"):
                continue  # a headless node serves no HTTP
            if value is True:  # a switch
                args.append(f"--{flag}")
            elif value is not None and value is not False:
                args += [f"--{flag}", str(value)]
        return args + node.flags + self.extra_flags

    def overlay_env(self) -> dict[str, str]:
        """The overlay's switches and the file's env: what every launch of this deployment needs."""
        return {BACKEND_ENV: self.backend, STRICT_ENV: "1" if self.strict else "0",
                "VLLM_PLUGINS": ",".join(PLUGINS), **self.env}

    def environment(self, state_dir: Path) -> dict[str, str]:
        """What the server process gets on top of the caller's environment."""
        return {"VLLM_CACHE_ROOT": str(state_dir / "cache" / "vllm"), **self.overlay_env()}


def _fail(source: Path, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{source}: {key}: {problem}")


_TYPE_NAMES = {"bool_type": "true or false", "int_type": "an integer", "string_type": "a string",
               "float_type": "a number", "dict_type": "a mapping", "model_type": "a mapping",
               "model_attributes_type": "a mapping"}


def _fields_at(loc: tuple[Any, ...]) -> dict[str, Any]:
    """The pydantic fields of the section at `loc` (() is the whole file)."""
    model: type[BaseModel] = DeploymentFile
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        model = next(a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel))
    return dict(model.model_fields)


def _problem(error: dict[str, Any]) -> str:
    """pydantic's error -> this project's wording (the value is always shown)."""
    kind, value, ctx, loc = error["type"], error.get("input"), error.get("ctx", {}), error["loc"]
    if kind == "extra_forbidden":
        known = ", ".join(_fields_at(loc[:-1]))
        return f"unknown section (known: {known})" if len(loc) == 1 else f"unknown key (known: {known})"
    if kind == "literal_error":
        section = _fields_at(loc[:-1])
        return f"{value!r} is not one of {', '.join(get_args(section[str(loc[-1])].annotation))}"
    if kind in _TYPE_NAMES:
        return f"must be {_TYPE_NAMES[kind]}, got {value!r}"
    bounds = {"greater_than_equal": ("at least", "ge"), "greater_than": ("more than", "gt"),
              "less_than": ("less than", "lt"), "less_than_equal": ("at most", "le")}
    if kind in bounds:
        words, key = bounds[kind]
        return f"must be {words} {ctx[key]}, got {value!r}"
    if kind == "missing":
        return "is required"
    return str(error["msg"])  # our own PydanticCustomError messages already read this way


def parse(source: Path, raw: Any) -> DeploymentFile:
    """Validate the parsed YAML; the first problem becomes one ConfigError line."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must be a mapping of sections ({', '.join(SECTIONS)}), got {type(raw).__name__}")
    try:
        return DeploymentFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        raise _fail(source, ".".join(map(str, first["loc"])), _problem(first)) from None


def _flag_args(source: Path, flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        flag = str(key).lstrip("-").replace("_", "-")
        if flag in OWNED_FLAGS:
            raise _fail(source, f"vllm.{key}", f"set it as {OWNED_FLAGS[flag][0]} instead")
        if flag == "api-key":  # a flag is printed by `serve` and logged by vLLM
            raise _fail(source, f"vllm.{key}", f"set server.api_key (or export {API_KEY_ENV}): it is never printed")
        if flag in NODE_FLAGS:
            raise _fail(source, f"vllm.{key}", "is set per node from the nodes: section and --role/--node-rank")
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
    for key, value in raw.items():
        env[key] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        if key.startswith("MOE_OVERLAY_"):
            raise _fail(source, f"env.{key}", "is set by moe-overlay itself: use the moe: section")
        if key == API_KEY_ENV:
            raise _fail(source, f"env.{key}", "would be printed with the command: set server.api_key instead")
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
    if env.get(AITER_FUSED_SHARED) in ("1", "true") and backend != "vllm":
        raise _fail(source, f"env.{AITER_FUSED_SHARED}",
                    f"makes AITER run the shared experts as routed ones (DeepSeek-V3: 257 local experts for the "
                    f"checkpoint's 256), which moe.backend={backend} does not model: set it to 0, or use "
                    f"moe.backend: vllm to keep vLLM's own AITER path")
    return env


def _model(source: Path, path: str | None, key: str = "model.path") -> tuple[str, str | None]:
    if not path:
        raise _fail(source, key, "is required (a local folder, hf:ORG/NAME, or builtin:NAME)")
    if path.startswith(BUILTIN_PREFIX):
        from .builtin_models import BUILTIN_NAMES, builtin_dir

        name = path[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_NAMES:
            have = ", ".join(BUILTIN_NAMES)
            raise _fail(source, key, f"{path!r}: no embedded model {name!r} (have: {have})")
        return str(builtin_dir(name)), name
    if path.startswith(HUB_PREFIX):
        return path[len(HUB_PREFIX):], None
    local = Path(os.path.expanduser(path))
    if not local.is_absolute():
        local = (source.parent / local).resolve()
    if not local.is_dir():
        raise _fail(source, key, f"{path!r}: {local} does not exist (use hf:ORG/NAME for a hub model)")
    if links := links_outside(local):  # served under this folder's name, read from elsewhere
        raise _fail(source, key, describe_links(local, links))
    return str(local), None


def _speculative(source: Path, spec: SpeculativeSection | None, parallel: ParallelSection) -> str | None:
    """The section as vLLM's `--speculative-config` JSON; what vLLM would refuse later is refused here."""
    if spec is None:
        return None
    key = "speculative_config"
    if spec.method in DRAFT_MODEL_METHODS and spec.model is None:
        raise _fail(source, f"{key}.model", f"is required with method {spec.method} (the draft model's checkpoint)")
    if spec.method in MODEL_FREE_METHODS and spec.model is not None:
        raise _fail(source, f"{key}.model", f"{spec.model!r}: method {spec.method} runs no draft model")
    tp = spec.draft_tensor_parallel_size
    if tp is not None and tp not in (1, parallel.tensor):
        raise _fail(source, f"{key}.draft_tensor_parallel_size",
                    f"{tp}: vLLM takes 1 or the target's parallel.tensor ({parallel.tensor})")
    values = spec.model_dump(exclude_none=True)
    if spec.model is not None and spec.model.startswith(BUILTIN_PREFIX):
        raise _fail(source, f"{key}.model", f"{spec.model!r}: no embedded draft models (use a local folder or "
                                            f"{HUB_PREFIX}ORG/NAME)")
    if spec.model is not None:
        values["model"], _ = _model(source, spec.model, f"{key}.model")
    return json.dumps(values)


def _check_nodes(source: Path, nodes: NodesSection, parallel: ParallelSection) -> None:
    if nodes.count == 1:
        return
    if nodes.head_address is None:
        raise _fail(source, "nodes.head_address", f"is required with nodes.count: {nodes.count}")
    if parallel.data % nodes.count:
        raise _fail(source, "nodes.count", f"{nodes.count} does not divide parallel.data ({parallel.data}): "
                                           f"vLLM's data-parallel launcher gives each node the same number of ranks")


def read_yaml(source: Path) -> Any:
    """Safe YAML loading (no Python objects), syntax errors as one line with the position."""
    import yaml

    if not source.is_file():
        raise ConfigError(f"{source}: config file not found")
    try:
        return yaml.safe_load(source.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: YAML syntax error: {where}{getattr(err, 'problem', err)}") from None


def load(path: str | os.PathLike[str]) -> Deployment:
    """Read and validate one deployment file."""
    source = Path(path)
    spec = parse(source, read_yaml(source))
    model, moe, par, server = spec.model, spec.moe, spec.parallel, spec.server
    _check_nodes(source, spec.nodes, par)
    model_arg, builtin = _model(source, model.path)
    return Deployment(
        source=source, model=model_arg, builtin=builtin,
        name=model.name or (builtin or Path(model_arg).name), dtype=model.dtype,
        max_model_len=model.max_model_len, quantization=model.quantization, precision=model.precision,
        backend=moe.backend, strict=moe.strict, tensor=par.tensor, pipeline=par.pipeline,
        data=par.data, expert=par.expert, host=server.host, port=server.port, api_key=server.api_key,
        nodes=spec.nodes, hardware=spec.hardware, gsm8k=spec.gsm8k,
        speculative=_speculative(source, spec.speculative_config, par),
        extra_flags=_flag_args(source, spec.vllm), env=_env(source, spec.env, moe.backend),
    )
