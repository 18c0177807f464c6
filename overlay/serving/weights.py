"""Swap a running server's weights in place, through vLLM's own endpoints, without mixing.

vLLM's in-place reload (`POST /collective_rpc {"method": "reload_weights"}`) runs between two
engine steps: a request still generating would finish its answer with the new weights. So the
swap drains first: `POST /pause?mode=wait` (in-flight requests finish on the old weights, new
ones queue), reload, `POST /resume`. Each request then runs on one set of weights.
The server needs `VLLM_SERVER_DEV_MODE=1` (vLLM serves these routes only then).

    python -m moe_overlay.serving.weights http://127.0.0.1:8000 [--path FOLDER]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from .config import API_KEY_ENV

RELOAD_TIMEOUT_S = 300.0


class SwapError(RuntimeError):
    """The server refused a step of the swap (the message names the step and its answer)."""


def _post(base_url: str, path: str, body: dict | None, api_key: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = b"" if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base_url.rstrip("/") + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=RELOAD_TIMEOUT_S) as response:
            response.read()
    except urllib.error.HTTPError as err:
        hint = " (is the server started with VLLM_SERVER_DEV_MODE=1?)" if err.code == 404 else ""
        raise SwapError(f"POST {path} -> {err.code}{hint}: {err.read()[:500].decode(errors='replace')}") from None


def swap_weights(base_url: str, path: str | None = None, api_key: str | None = None) -> None:
    """Reload the weights from `path` (the served folder when None) between requests."""
    kwargs = {} if path is None else {"weights_path": str(path)}
    _post(base_url, "/pause?mode=wait", None, api_key)
    try:
        _post(base_url, "/collective_rpc", {"method": "reload_weights", "kwargs": kwargs}, api_key)
    finally:
        _post(base_url, "/resume", None, api_key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_overlay.serving.weights", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--path", help="checkpoint folder to load (same architecture); default: the served one")
    args = parser.parse_args(argv)
    try:
        swap_weights(args.url, args.path, os.environ.get(API_KEY_ENV))
    except (SwapError, urllib.error.URLError) as err:
        print(f"weights: error: {err}", file=sys.stderr)
        return 1
    print(f"weights: reloaded from {args.path or 'the served folder'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
