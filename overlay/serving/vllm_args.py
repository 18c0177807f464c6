"""Check a resolved command line against the installed vLLM's own `vllm serve` argument parser."""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
from types import ModuleType
from typing import Any

from .config import CLI_MODULE, ConfigError, Deployment, Node


def server_flags(argv: list[str]) -> list[str]:
    """The flags of `python -m MODULE [serve] FLAGS...` as `vllm serve` reads them."""
    flags = argv[3:]
    return flags[1:] if argv[2] == CLI_MODULE else flags


def cli_args() -> ModuleType:
    """vLLM's module of `vllm serve`'s arguments (make_arg_parser, validate_parsed_serve_args):
    under entrypoints/launchers up to 0.32, under entrypoints/common from 0.33."""
    try:
        return importlib.import_module("vllm.entrypoints.launchers.cli_args")
    except ModuleNotFoundError:
        return importlib.import_module("vllm.entrypoints.common.cli_args")


@functools.cache
def serve_parser() -> Any:
    """Built once (about 1.5 s on 2 cores): parsing keeps no state between command lines."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return cli_args().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def check_flags(flags: list[str]) -> None:
    """Parse as `vllm serve` does (make_arg_parser, its validation, the engine arguments it builds);
    a flag or value the installed vLLM refuses raises ValueError with vLLM's own message."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = serve_parser()
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            args = parser.parse_args(flags)
    except SystemExit:
        raise ValueError(messages.getvalue().strip().splitlines()[-1]) from None
    cli_args().validate_parsed_serve_args(args)
    AsyncEngineArgs.from_cli_args(args)


def check_env(env: dict[str, str]) -> None:
    """Every VLLM_* variable must be one the installed vLLM reads, with a value it accepts (its own
    getter reads it, as at start-up); a typo would otherwise be ignored in silence."""
    import vllm.envs as envs

    saved = dict(os.environ)
    try:
        for name, value in env.items():
            if not name.startswith("VLLM_"):
                continue
            if name not in envs.environment_variables:
                raise ValueError(f"{name}: the installed vLLM reads no such environment variable")
            os.environ[name] = value
            try:
                envs.environment_variables[name]()
            except ValueError as err:
                raise ValueError(f"{name}={value}: {err}") from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_deployment(deployment: Deployment, nodes: list[Node] | None = None) -> None:
    """Every node's command line must parse with the installed vLLM and its VLLM_* environment be
    one vLLM reads; ConfigError names file, node or variable."""
    try:
        check_env(deployment.env)
    except ValueError as err:
        raise ConfigError(f"{deployment.source}: env.{err}") from None
    for node in nodes or deployment.all_nodes():
        try:
            check_flags(server_flags(deployment.argv("python", node)))
        except ValueError as err:
            raise ConfigError(f"{deployment.source}: node {node.rank} ({node.role}): vLLM refuses the command "
                              f"line: {err}") from None


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
