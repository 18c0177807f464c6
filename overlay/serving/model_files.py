"""What a model folder really contains: files that link out of it are named, not followed silently.

A deployment names a folder; vLLM reads whatever its entries point to. A symbolic link inside it
that leads elsewhere (another model's weights, a file outside the project) would be served under
the folder's name without anyone seeing it, so `moe-overlay serve` refuses the folder and names
each such link with its target.
"""

from __future__ import annotations

from pathlib import Path


def links_outside(folder: Path) -> list[tuple[Path, Path]]:
    """(link, where it leads) for every entry under `folder` that resolves outside it."""
    root = folder.resolve()
    found = []
    for entry in sorted(folder.rglob("*")):
        if entry.is_symlink():
            target = entry.resolve()
            if not target.is_relative_to(root):
                found.append((entry, target))
    return found


def describe_links(folder: Path, links: list[tuple[Path, Path]]) -> str:
    shown = ", ".join(f"{link.relative_to(folder)} -> {target}" for link, target in links[:3])
    more = f" and {len(links) - 3} more" if len(links) > 3 else ""
    return (f"{folder} has links that lead out of it: {shown}{more} (name the folder that holds the files, "
            f"copy them in, or use hf:ORG/NAME for a hub model)")
