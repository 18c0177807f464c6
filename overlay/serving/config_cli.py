"""`moe-overlay config check [FILES]` and `moe-overlay config export-recipe FILE`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ConfigError, Deployment, load

DEFAULT_GLOB = "configs/*.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate deployment files, parse every node's command line with the "
                                         "installed vLLM's own argument parser, and name the quant method it "
                                         "hands the MoE layers (mapped to the adapter, or why not)")
    check.add_argument("files", nargs="*", help=f"deployment YAMLs (default: {DEFAULT_GLOB})")
    check.add_argument("--no-vllm", action="store_true", help="check the files only (do not import vLLM)")
    export = sub.add_parser("export-recipe", help="write the deployment as a YAML of vLLM's recipes repository")
    export.add_argument("file", help="deployment YAML")
    export.add_argument("-o", "--output", help="write here instead of standard output")


def _check(args: argparse.Namespace) -> int:
    files = [Path(f) for f in args.files] or sorted(Path().glob(DEFAULT_GLOB))
    if not files:
        print(f"moe-overlay config check: error: no files given and none match {DEFAULT_GLOB}", file=sys.stderr)
        return 2
    failed = 0
    for path in files:
        try:
            deployment = load(path)
            checked = "file only" if args.no_vllm else _check_with_vllm(deployment)
        except ConfigError as err:
            print(f"FAIL {err}")
            failed += 1
            continue
        print(f"ok   {path} ({deployment.nodes.count} node(s); {checked})")
    return 1 if failed else 0


def _check_with_vllm(deployment: Deployment) -> str:
    """Every node's command line parsed, and the MoE layers' quant method named: a strict deployment
    whose backend the overlay cannot give them fails here, as it would at start-up."""
    from .moe_quant import NotBuiltHere, checkpoint_folder, moe_quant, speculative_draft
    from .vllm_args import check_deployment, vllm_version

    check_deployment(deployment)
    parsed = f"vLLM {vllm_version()} parses every node's command line"
    try:
        checkpoint = checkpoint_folder(deployment)
    except OSError as err:  # the twin that stands in for it cannot be built here (a read-only state dir)
        return f"{parsed}; MoE quant method not checked: {err}"
    if checkpoint is None:
        return f"{parsed}; MoE quant method not checked: no config.json of {deployment.model} here"
    folder, what = checkpoint
    try:
        found = moe_quant(folder, deployment)
    except NotBuiltHere as err:
        checked = f"{parsed}; MoE quant method of {what} not checked: {err}"
    else:
        if not found.mapped and deployment.strict and deployment.backend not in ("auto", "vllm"):
            raise ConfigError(f"{deployment.source}: moe.backend: {deployment.backend} with moe.strict stops at "
                              f"start-up: vLLM {vllm_version()} gives the MoE layers of {what}: {found}")
        checked = f"{parsed}; MoE layers of {what}: {found}"
    return checked if deployment.speculative is None else f"{checked}; speculative draft: " \
        f"{speculative_draft(folder, deployment)}"


def _export(args: argparse.Namespace) -> int:
    from .recipe import dump, recipe
    from .vllm_args import check_deployment, vllm_version

    try:
        deployment = load(args.file)
        check_deployment(deployment)
        text = dump(recipe(deployment, vllm_version()))
    except ConfigError as err:
        print(f"moe-overlay config export-recipe: error: {err}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def run(args: argparse.Namespace) -> int:
    return _check(args) if args.action == "check" else _export(args)
