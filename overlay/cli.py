"""`moe-overlay` command line. Each subcommand lives in its own module; those modules keep heavy
imports (vLLM, Triton) inside run(), so `moe-overlay tune` never pays for vLLM nor `serve` for Triton."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module exposing add_arguments(parser) and run(args) -> int, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "tune": ("moe_overlay.backends.triton_moe.tune", "tune the Triton MoE kernels' launch configurations on this GPU"),
    "serve": ("moe_overlay.serving.serve", "serve a deployment YAML with vLLM's OpenAI-compatible server"),
    "config": ("moe_overlay.serving.config_cli", "check deployment YAMLs, export one as a vLLM recipe"),
    "eval": ("moe_overlay.serving.eval_gsm8k", "accuracy of a deployment with lm-eval (gsm8k), gated by its config"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-overlay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
