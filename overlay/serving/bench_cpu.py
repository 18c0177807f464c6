"""`make bench-cpu`: decode throughput of the served tiny model, overlay vs stock vLLM, one run.

Each variant gets its own server on loopback; all are up together and the repeats are
interleaved (stock, vllm, torch, stock, ...) so machine drift hits every variant alike.
The same fixed workload is timed and the ratios to stock are printed with their spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from ..patches.plugin import DISABLE_ENV
from .builtin_models import ensure_builtin
from .config import load
from .harness import Server, serve

VARIANTS = {  # name -> (environment, extra serve arguments)
    "stock vLLM": ({DISABLE_ENV: "1"}, ()),
    "overlay, backend vllm": ({}, ("--backend", "vllm")),
    "overlay, backend torch": ({}, ("--backend", "torch")),
}
PROMPT = "Mixture-of-Experts layers route every token to a few experts, so"
SETTLE_S = 1.0  # let the previous server's OpenMP threads stop spinning on the shared core


def _workload(server: Server, model: str, requests: int, tokens: int) -> float:
    """Tokens per second for `requests` concurrent greedy completions of `tokens` tokens."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        done = list(pool.map(lambda _: server.post("/v1/completions", body), range(requests)))
    elapsed = time.perf_counter() - start
    return sum(r["usage"]["completion_tokens"] for r in done) / elapsed


def _spread(values: list[float]) -> str:
    med = statistics.median(values)
    spread = 100 * (max(values) - min(values)) / med
    return f"{med:8.1f} tok/s  (min {min(values):.1f}, max {max(values):.1f}, spread {spread:.1f}%)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/tiny-mixtral.yaml")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests per repeat")
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens per request")
    args = parser.parse_args(argv)
    deployment = load(args.config)
    if deployment.builtin:
        ensure_builtin(deployment.builtin)
    logs = Path(tempfile.mkdtemp(prefix="moe-overlay-bench-"))
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with ExitStack() as stack:
        servers = {}
        for i, (name, (env, extra)) in enumerate(VARIANTS.items(), 1):
            print(f"[{i}/{len(VARIANTS)}] starting {name} (log {logs / f'{i}.log'})", flush=True)
            servers[name] = stack.enter_context(serve(args.config, logs / f"{i}.log", env, extra))
            _workload(servers[name], deployment.name, args.requests, 8)  # warm-up
        for r in range(args.repeats):
            for name, server in servers.items():
                time.sleep(SETTLE_S)
                results[name].append(_workload(server, deployment.name, args.requests, args.tokens))
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {v[-1]:.0f}" for n, v in results.items()),
                  flush=True)
    print(f"\n{args.requests} concurrent requests x {args.tokens} tokens, {args.repeats} repeats, "
          f"model {deployment.name} ({deployment.dtype}), config {args.config}")
    ratios = {}
    for name, values in results.items():
        # Each repeat's ratio pairs measurements taken back to back, so slow drift cancels.
        paired = [v / s for v, s in zip(values, results["stock vLLM"], strict=True)]
        ratios[name] = statistics.median(paired)
        print(f"  {name:24s} {_spread(values)}   ratio to stock {ratios[name]:.3f} "
              f"(paired repeats {min(paired):.3f}..{max(paired):.3f})")
    cost = 1 - ratios["overlay, backend vllm"]
    print(f"\noverlay with upstream's kernel costs {100 * cost:+.1f}% against stock (target: under 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
