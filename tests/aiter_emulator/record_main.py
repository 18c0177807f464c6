"""Record the contract of a newer ROCm/aiter (signatures, defaults, enums) for the tests,
which cannot reach GitHub: parse a checkout and write aiter_main_contract.json.

    git clone https://github.com/ROCm/aiter /tmp/aiter && \\
    python -m tests.aiter_emulator.record_main /tmp/aiter "$(git -C /tmp/aiter rev-parse HEAD)" \\
        "$(git -C /tmp/aiter log -1 --format=%cs)"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .sources import MAIN_RECORD, read_contract


def record(root: Path, commit: str, date: str) -> dict[str, Any]:
    contract = read_contract(root, f"main@{commit[:8]}")
    return {
        "repository": "https://github.com/ROCm/aiter",
        "commit": commit,
        "date": date,
        "version": contract.version,
        "enums": contract.enums,
        "functions": contract.functions,
        "flydsl": contract.flydsl,
    }


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    MAIN_RECORD.write_text(json.dumps(record(Path(sys.argv[1]), sys.argv[2], sys.argv[3]), indent=1) + "\n")
    print(f"wrote {MAIN_RECORD}")
