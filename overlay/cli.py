"""`moe-overlay` command line. Each subcommand lives in its own module, imported only when that
subcommand runs (`tune` on a GPU machine with torch and triton alone never imports the serving
stack); those modules keep heavy imports (vLLM, Triton) inside run()."""

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


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: every subcommand listed, only the one `argv` names given its arguments."""
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="moe-overlay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).add_arguments(sp)
        sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
