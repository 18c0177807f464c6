"""`make load`: N concurrent streaming clients send R completions of mixed prompt and output
lengths to a server on this machine; a tenth are cancelled mid-stream. Reports failures, time to
first token and per output token (p50, p99), output tokens/s, the server's memory before and
after, and whether it is healthy afterwards.

Loopback only (it refuses any other address), bounded in requests, clients and time, and stops by
itself. Without --url it starts the deployment given by --config on a free loopback port and
stops it at the end.

    python -m moe_overlay.serving.load --config configs/tiny-mixtral.yaml --clients 64 --requests 500
    python -m moe_overlay.serving.load --url http://127.0.0.1:8000 --clients 8 --requests 40
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import math
import os
import random
import socket
import string
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .config import API_KEY_ENV
from .proctree import descendants

MAX_CLIENTS = 256
MAX_REQUESTS = 10_000
CANCEL_EVERY = 10  # one request in ten is cancelled mid-stream
CANCEL_AFTER_TOKENS = 2


class LoadError(ValueError):
    """A load run that this tool refuses to start (message says why)."""


def loopback_target(url: str) -> tuple[str, int]:
    """host and port of `url`, refused unless every address it names is a loopback address."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise LoadError(f"{url!r}: give http://HOST:PORT of a server on this machine")
    port = parts.port or 80
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as err:
        raise LoadError(f"{url!r}: cannot resolve {parts.hostname!r}: {err}") from None
    outside = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if outside:
        raise LoadError(f"{url!r}: {parts.hostname} is {', '.join(outside)}, not loopback: "
                        "this tool only loads a server on this machine")
    return parts.hostname, port


@dataclass
class Plan:
    index: int
    prompt: str
    max_tokens: int
    cancel: bool


@dataclass
class Outcome:
    plan: Plan
    status: str = "failed"  # completed | cancelled | failed | not sent
    tokens: int = 0
    ttft_s: float | None = None
    per_token_s: float | None = None
    error: str = ""


def make_plans(requests: int, prompt_lengths: list[int], output_lengths: list[int], seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(requests):
        length = rng.choice(prompt_lengths)
        prompt = "".join(rng.choice(string.ascii_letters + " ") for _ in range(length))
        plans.append(Plan(i, prompt, rng.choice(output_lengths), cancel=i % CANCEL_EVERY == CANCEL_EVERY - 1))
    return plans


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def stream_one(host: str, port: int, model: str, plan: Plan, api_key: str | None, timeout: float) -> Outcome:
    """One streaming completion; a planned cancellation closes the connection after a few tokens."""
    outcome = Outcome(plan)
    body = {"model": model, "prompt": plan.prompt, "max_tokens": plan.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    start = time.monotonic()
    first = last = None
    usage = None
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), _headers(api_key))
        response = conn.getresponse()
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
            return outcome
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if not chunk.get("choices"):
                continue
            now = time.monotonic()
            first = first or now
            last = now
            outcome.tokens += 1
            if plan.cancel and outcome.tokens >= CANCEL_AFTER_TOKENS:
                outcome.status = "cancelled"
                return outcome
        produced = usage["completion_tokens"] if usage else None
        if produced != plan.max_tokens:
            outcome.error = f"stream ended with {produced} of {plan.max_tokens} tokens"
            return outcome
        outcome.status = "completed"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        outcome.error = f"{type(err).__name__}: {err}"
    finally:
        conn.close()  # for a cancelled request: the server sees the client go away
        if first is not None:
            outcome.ttft_s = first - start
            if last is not None and outcome.tokens > 1:
                outcome.per_token_s = (last - first) / (outcome.tokens - 1)
    return outcome


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants (Linux /proc), MiB."""
    total_kib = 0
    for current in [pid, *descendants(pid)]:
        try:
            status = (Path("/proc") / str(current) / "status").read_text()
        except OSError:
            continue
        total_kib += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total_kib / 1024 if total_kib else None


def _get(host: str, port: int, path: str, api_key: str | None, timeout: float = 10) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=_headers(api_key))
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else None
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        return 0, str(err)
    finally:
        conn.close()


@dataclass
class Report:
    clients: int
    requests: int
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    not_sent: int = 0
    wall_s: float = 0.0
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    per_token_ms: dict[str, float | None] = field(default_factory=dict)
    server_rss_mib: dict[str, float | None] = field(default_factory=dict)
    healthy_after: bool = False
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        def ms(d: dict[str, float | None]) -> str:
            return ", ".join(f"{k} {'n/a' if v is None else f'{v:.1f}'} ms" for k, v in d.items())

        def mib(v: float | None) -> str:
            return "not measured" if v is None else f"{v:.0f} MiB"

        rss = self.server_rss_mib
        return [
            f"requests: {self.requests} from {self.clients} clients in {self.wall_s:.1f} s: "
            f"{self.completed} completed, "
            f"{self.cancelled} cancelled on purpose, {self.failed} failed, {self.not_sent} not sent (time bound)",
            f"output: {self.output_tokens} tokens, {self.output_tokens_per_s:.1f} tokens/s",
            f"time to first token: {ms(self.ttft_ms)}",
            f"time per output token: {ms(self.per_token_ms)}",
            f"server memory (RSS of its process tree): before {mib(rss.get('before'))}, after {mib(rss.get('after'))}",
            f"healthy afterwards: {'yes' if self.healthy_after else 'NO'}",
            *(f"failure: {f}" for f in self.failures[:5]),
        ]


def run_load(url: str, clients: int, requests: int, max_seconds: float, prompt_lengths: list[int],
             output_lengths: list[int], model: str | None = None, server_pid: int | None = None,
             api_key: str | None = None, seed: int = 0, request_timeout: float = 300) -> Report:
    if not 1 <= clients <= MAX_CLIENTS or not 1 <= requests <= MAX_REQUESTS:
        raise LoadError(f"clients must be 1..{MAX_CLIENTS} and requests 1..{MAX_REQUESTS} "
                        f"(got {clients} and {requests})")
    host, port = loopback_target(url)
    status, models = _get(host, port, "/v1/models", api_key)
    if status != 200:
        raise LoadError(f"{url}: GET /v1/models -> {status or 'no answer'}: {models}")
    model = model or models["data"][0]["id"]
    plans = make_plans(requests, prompt_lengths, output_lengths, seed)
    report = Report(clients, requests)
    report.server_rss_mib["before"] = tree_rss_mib(server_pid) if server_pid else None
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    pending = iter(plans)
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                plan = next(pending, None)
            if plan is None:
                return
            outcome = stream_one(host, port, model, plan, api_key, min(request_timeout, max_seconds))
            with lock:
                outcomes.append(outcome)

    start = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()) + request_timeout)
    report.wall_s = time.monotonic() - start
    with lock:
        finished = list(outcomes)
    report.not_sent = requests - len(finished)
    for outcome in finished:
        if outcome.status == "completed":
            report.completed += 1
        elif outcome.status == "cancelled":
            report.cancelled += 1
        else:
            report.failed += 1
            report.failures.append(f"request {outcome.plan.index}: {outcome.error}")
    report.output_tokens = sum(o.tokens for o in finished)
    report.output_tokens_per_s = report.output_tokens / report.wall_s if report.wall_s else 0.0
    ttft = [o.ttft_s * 1e3 for o in finished if o.status == "completed" and o.ttft_s is not None]
    per_token = [o.per_token_s * 1e3 for o in finished if o.status == "completed" and o.per_token_s is not None]
    report.ttft_ms = {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}
    report.per_token_ms = {"p50": percentile(per_token, 50), "p99": percentile(per_token, 99)}
    health, _ = _get(host, port, "/health", api_key)
    status, _ = _get(host, port, "/v1/models", api_key)
    report.healthy_after = health == 200 and status == 200
    report.server_rss_mib["after"] = tree_rss_mib(server_pid) if server_pid else None
    return report


def _lengths(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated positive integers")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    parser.add_argument("--config", default="configs/tiny-mixtral.yaml",
                        help="without --url: start this deployment on a free loopback port, stop it after")
    parser.add_argument("--clients", type=int, default=8, help=f"concurrent streaming clients (at most {MAX_CLIENTS})")
    parser.add_argument("--requests", type=int, default=40, help=f"requests in all (at most {MAX_REQUESTS})")
    parser.add_argument("--max-seconds", type=float, default=600, help="stop sending after this long")
    parser.add_argument("--prompt-lengths", type=_lengths, default=[8, 64, 256], help="prompt characters to mix")
    parser.add_argument("--output-lengths", type=_lengths, default=[8, 32, 128], help="output tokens to mix")
    parser.add_argument("--pid", type=int, help="the server's process, for its memory (known when it is started here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")


def run(args: argparse.Namespace) -> int:
    api_key = os.environ.get(API_KEY_ENV)
    common = dict(clients=args.clients, requests=args.requests, max_seconds=args.max_seconds,
                  prompt_lengths=args.prompt_lengths, output_lengths=args.output_lengths, api_key=api_key,
                  seed=args.seed)
    try:
        if args.url:
            report = run_load(args.url, server_pid=args.pid, **common)
        else:
            from .harness import serve

            log = Path("var") / "load" / "server.log"
            print(f"load: starting {args.config} (log: {log})", file=sys.stderr, flush=True)
            with serve(args.config, log) as server:
                report = run_load(server.base_url, server_pid=server.process.pid, **common)
    except LoadError as err:
        print(f"load: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(report.lines()))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.failed == 0 and report.not_sent == 0 and report.healthy_after else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_overlay.serving.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
