"""Contract checks: does an upstream symbol still have the shape the overlay relies on?

A check imports nothing until run, and reports drift as one readable line per symbol.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass


class ContractDriftError(RuntimeError):
    """Upstream vLLM no longer matches what a hook of the overlay expects."""


def _resolve(path: str) -> object:
    """`pkg.module:Attr.attr` -> the object (raises LookupError naming the missing part)."""
    module_name, _, attrs = path.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as err:
        raise LookupError(f"module {module_name} cannot be imported ({err})") from None
    for part in filter(None, attrs.split(".")):
        if not hasattr(obj, part):
            raise LookupError(f"{part!r} is missing")
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class Expect:
    """What one upstream symbol must look like.

    `params`: the leading parameter names of a callable, in order (extra trailing
    parameters with defaults are tolerated: upstream adding options is not drift).
    `fields`: names a dataclass must have. `subclass_of`: a base it must derive from.
    `mentions`: strings its source must contain, for names upstream creates at run time
    (instance attributes, parameters registered in `create_weights`) that no import can check.
    """

    symbol: str
    params: tuple[str, ...] | None = None
    fields: tuple[str, ...] = ()
    subclass_of: str | None = None
    mentions: tuple[str, ...] = ()

    def problem(self) -> str | None:
        try:
            obj = _resolve(self.symbol)
        except LookupError as err:
            return f"{self.symbol}: expected to exist, found {err}"
        if self.params is not None:
            if not callable(obj):
                return f"{self.symbol}: expected a callable, found {type(obj).__name__}"
            params = list(inspect.signature(obj).parameters.values())  # type: ignore[arg-type]
            found = tuple(p.name for p in params)
            lead = found[: len(self.params)]
            extra_required = [
                p.name for p in params[len(self.params):]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            if lead != self.params or extra_required:
                return (f"{self.symbol}: expected parameters ({', '.join(self.params)}), "
                        f"found ({', '.join(found)})")
        if self.fields:
            have = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set(dir(obj))
            missing = [f for f in self.fields if f not in have]
            if missing:
                return f"{self.symbol}: expected fields {list(self.fields)}, missing {missing}"
        if self.subclass_of is not None:
            try:
                base = _resolve(self.subclass_of)
            except LookupError as err:
                return f"{self.subclass_of}: expected to exist, found {err}"
            if not (isinstance(obj, type) and isinstance(base, type) and issubclass(obj, base)):
                return f"{self.symbol}: expected a subclass of {self.subclass_of}, found {obj!r}"
        if self.mentions:
            try:
                source = inspect.getsource(obj)  # type: ignore[arg-type]
            except (OSError, TypeError) as err:
                return f"{self.symbol}: expected readable source, found {err}"
            missing = [m for m in self.mentions if m not in source]
            if missing:
                return f"{self.symbol}: expected its source to use {missing}, found none of them"
        return None


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"
