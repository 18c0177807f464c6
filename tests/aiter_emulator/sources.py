"""AITER's own files, read without importing `aiter` (which raises without ROCm).

Two versions of AITER's contract are known here: the installed PyPI `amd-aiter` (pinned in
the project's test extra) and a newer ROCm/aiter main, recorded in aiter_main_contract.json
by `python -m tests.aiter_emulator.record_main <aiter checkout> <commit> <date>`.
Code is loaded from the installed package only, by path or by lifting single definitions
out of a file with `ast` (the rest of the file, and its `aiter` imports, never run).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from moe_overlay.backends.aiter.capability import AiterFeatures
from moe_overlay.backends.aiter.ops import AITER_DISTRIBUTION, AITER_ENUMS, AITER_FUNCTIONS

MAIN_RECORD = Path(__file__).with_name("aiter_main_contract.json")
ENUM_HEADERS = ("aiter_meta/csrc/include/aiter_enum.h", "csrc/include/aiter_enum.h")  # wheel, checkout


def installed_root() -> Path:
    """The folder holding the installed `aiter/` (and `aiter_meta/`)."""
    return Path(str(importlib.metadata.distribution(AITER_DISTRIBUTION).locate_file("")))


def installed_version() -> str:
    return importlib.metadata.version(AITER_DISTRIBUTION)


def module_file(root: Path, module: str) -> Path:
    return root / (module.replace(".", "/") + ".py")


# -- the contract: signatures and enums, parsed ---------------------------------------------


def parse_enums(header: str) -> dict[str, dict[str, int]]:
    """`enum class X : int { A = -1, B, ... }` blocks of a C++ header -> {X: {A: -1, B: 0}}."""
    enums: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"enum class (\w+)\s*:\s*int\s*\{([^}]*)\}", header):
        members, value = {}, -1
        for item in re.sub(r"//[^\n]*", "", body).split(","):
            if not item.strip():
                continue
            member, _, explicit = item.partition("=")
            value = int(explicit) if explicit.strip() else value + 1
            members[member.strip()] = value
        enums[name] = members
    return enums


def parse_params(source: str, function: str) -> dict[str, str | None]:
    """The parameters of top-level `def function` in `source`: name -> its default's source
    text, or None where it has no default."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            args = node.args
            positional = args.posonlyargs + args.args
            defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
            pairs = [*zip(positional, defaults, strict=True), *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
            return {a.arg: None if d is None else ast.unparse(d) for a, d in pairs}
    raise LookupError(f"no top-level def {function}")


@dataclass(frozen=True)
class AiterContract:
    """One AITER version as the backend meets it: enums and the functions it calls."""

    version: str
    enums: dict[str, dict[str, int]]
    functions: dict[str, dict[str, str | None]]  # function -> {parameter: its default (source), None if none}
    flydsl: bool  # fused_moe can dispatch to FlyDSL kernels

    def keyword_problems(self, function: str, kwargs: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """(keywords `function` does not take, parameters without a default that are not given)."""
        params = self.functions[function]
        unknown = sorted(set(kwargs) - set(params))
        missing = sorted(p for p, default in params.items() if default is None and p not in kwargs)
        return unknown, missing

    def features(self) -> AiterFeatures:
        return AiterFeatures.of(self.version, list(self.enums["ActivationType"]),
                                list(self.functions["fused_moe"]), self.flydsl)


def read_contract(root: Path, version: str) -> AiterContract:
    """Parse an AITER tree (installed package or git checkout) at `root`."""
    header = next(root / h for h in ENUM_HEADERS if (root / h).exists())
    enums = parse_enums(header.read_text())
    functions = {name: parse_params(module_file(root, module).read_text(), name)
                 for name, module in AITER_FUNCTIONS.items()}
    flydsl = "is_flydsl_available" in module_file(root, AITER_FUNCTIONS["fused_moe"]).read_text()
    return AiterContract(version, {e: enums[e] for e in AITER_ENUMS}, functions, flydsl)


@functools.cache
def installed_contract() -> AiterContract:
    return read_contract(installed_root(), installed_version())


def main_record() -> dict[str, Any]:
    return json.loads(MAIN_RECORD.read_text())


@functools.cache
def main_contract() -> AiterContract:
    r = main_record()
    return AiterContract(r["version"], r["enums"], r["functions"], r["flydsl"])


# -- code, loaded from the installed package --------------------------------------------------


def load_file(relpath: str) -> ModuleType:
    """A plain-torch file of the installed package, as a module of its own."""
    path = installed_root() / relpath
    spec = importlib.util.spec_from_file_location(f"aiter_file_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_aiter_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "aiter"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "aiter" for a in node.names)


class _DropAiterImports(ast.NodeTransformer):
    """Imports of `aiter` inside functions become `pass`: the names come from `env`."""

    def visit_Import(self, node: ast.Import) -> ast.stmt:
        return ast.Pass() if _is_aiter_import(node) else node

    visit_ImportFrom = visit_Import


def load_definitions(relpath: str, names: list[str] | None, env: dict[str, Any]) -> SimpleNamespace:
    """Run only the definitions `names` (all, if None) of an installed AITER file, with its
    non-AITER imports, in a namespace seeded with `env` (what its AITER imports would give)."""
    path = installed_root() / relpath
    tree = ast.parse(path.read_text(), str(path))
    namespace: dict[str, Any] = {"__name__": f"aiter_defs_{path.stem}", **env}
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            if not _is_aiter_import(node):
                try:
                    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
                except ImportError:
                    pass  # e.g. triton: only needed by definitions we do not load
            continue
        if names is None or _defined_names(node) & set(names):
            node = _DropAiterImports().visit(node)
            exec(compile(ast.fix_missing_locations(ast.Module([node], [])), str(path), "exec"), namespace)
    wanted = names if names is not None else [k for k in namespace if not k.startswith("__")]
    missing = [n for n in wanted if n not in namespace]
    if missing:
        raise LookupError(f"{relpath} defines none of {missing}")
    return SimpleNamespace(**{n: namespace[n] for n in wanted})


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()
