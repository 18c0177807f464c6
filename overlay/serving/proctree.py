"""A process's descendants from Linux /proc. Standard library only and no package imports, so
that docker/standin/image_test.py (run by the system Python, without the package installed)
loads this file by its path."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The process's descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found
