"""The per-layer MoE table printed at start-up (plain text, no vLLM import)."""

from __future__ import annotations

from typing import Any

COLUMNS = ("layer", "backend", "kernel", "layout", "quantisation", "tuned", "reason")


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if column == "tuned":
        return {True: "tuned", False: "untuned"}.get(value, "n/a")
    return "" if value is None else str(value)


def format_table(title: str, rows: list[dict[str, Any]]) -> str:
    cells = [[_cell(r, c) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(COLUMNS)]
    line = "  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True))
    body = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join([f"[moe-overlay] {title}: {len(rows)} MoE layers", line, "-" * len(line), *body])
