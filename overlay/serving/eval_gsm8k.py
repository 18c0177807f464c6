"""`moe-overlay eval gsm8k CONFIG`: lm-eval's gsm8k, 5-shot, through its `local-completions` model
against the deployment's server (started here, or `--url` for one already running); a JSON and
a Markdown report; exit status 1 below the config's gate.

lm-eval does the evaluation: its task (or, with `--data-dir`, the shipped copy of it that reads
local JSONL files), its prompts, its filters and its metric. Nothing of them is rewritten here."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import API_KEY_ENV, GATE_Z, GSM8K_QUESTIONS, ConfigError, Deployment, gsm8k_gate, load

TASK = "gsm8k"  # lm-eval's own task, from the hub
OFFLINE_TASK_FILE = Path(__file__).with_name("gsm8k_offline.yaml")
METRIC = "exact_match,flexible-extract"
STRICT_METRIC = "exact_match,strict-match"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    gsm8k = sub.add_parser("gsm8k", help="lm-eval gsm8k, 5-shot, flexible-extract, gated by the config")
    gsm8k.add_argument("config", help="deployment YAML (its server, tokenizer and gsm8k gate)")
    gsm8k.add_argument("--url", help="a server of this deployment already running (else one is started here)")
    gsm8k.add_argument("--limit", type=int, help="evaluate the first N questions only (a wider gate)")
    gsm8k.add_argument("--data-dir", type=Path,
                       help="folder with GSM8K's train.jsonl and test.jsonl (offline; default: the hub)")
    gsm8k.add_argument("--output", type=Path, help="report folder (default var/eval/<config name>)")
    gsm8k.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    gsm8k.add_argument("--start-timeout", type=float, default=3600, help="seconds to wait for the server")


@dataclass
class Verdict:
    status: str  # pass | fail | not gated
    passed: bool
    reason: str


def verdict(score: float, published: float | None, questions: int) -> Verdict:
    """Pass when the score is at most GATE_Z standard errors of the published figure below it, the
    standard error taken on the questions actually run (all 1,319: the config's gate; a --limit
    run gets the wider gate its fewer questions warrant)."""
    if published is None:
        return Verdict("not gated", True, "the config has no gsm8k section")
    gate = gsm8k_gate(published, questions)
    if score >= gate:
        return Verdict("pass", True, f"{score:.4f} >= gate {gate:.4f} on {questions} questions")
    return Verdict("fail", False, f"{score:.4f} < gate {gate:.4f} on {questions} questions")


def offline_task(data_dir: Path) -> dict[str, Any]:
    """The shipped task definition with its data files filled in."""
    import yaml

    files = {split: data_dir / f"{split}.jsonl" for split in ("train", "test")}
    for split, path in files.items():
        if not path.is_file():
            raise ConfigError(f"{data_dir}: no {path.name} ({split} split of GSM8K as JSONL)")
    task = yaml.safe_load(OFFLINE_TASK_FILE.read_text())
    task["dataset_kwargs"]["data_files"] = {split: str(path) for split, path in files.items()}
    return task


def model_args(dep: Deployment, url: str, concurrency: int) -> dict[str, Any]:
    """lm-eval's local-completions against the server; a local model folder gives the tokenizer
    (no hub access), a hub model lets lm-eval use the server's own /tokenize."""
    args: dict[str, Any] = {"model": dep.name, "base_url": f"{url.rstrip('/')}/v1/completions",
                            "num_concurrent": concurrency, "max_retries": 3}
    if Path(dep.model).is_dir():
        args.update(tokenizer_backend="huggingface", tokenizer=dep.model)
    else:
        args.update(tokenizer_backend="auto", tokenizer=dep.model)
    if dep.max_model_len:
        args["max_length"] = dep.max_model_len
    return args


def api_key(dep: Deployment) -> str | None:
    """The server's key (server.api_key, else VLLM_API_KEY): sent as a header, never written down."""
    return dep.api_key.get_secret_value() if dep.api_key else os.environ.get(API_KEY_ENV)


def moe_table(url: str, key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url.rstrip('/')}/v1/moe", headers=headers),
                                    timeout=60) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, ValueError, TimeoutError) as err:
        return {"error": f"GET /v1/moe: {err}"}


def evaluate(dep: Deployment, url: str, args: argparse.Namespace) -> dict[str, Any]:
    import lm_eval

    if key := api_key(dep):
        os.environ["OPENAI_API_KEY"] = key  # where local-completions reads its bearer token
    task: str | dict[str, Any] = offline_task(args.data_dir) if args.data_dir else TASK
    name = task["task"] if isinstance(task, dict) else task
    print(f"[moe-overlay eval] lm-eval {name}, 5-shot, against {url}"
          f"{f', first {args.limit} questions' if args.limit else ''}", file=sys.stderr, flush=True)
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args(dep, url, args.concurrency),
                                  tasks=[task], limit=args.limit, log_samples=False)
    if out is None:  # lm-eval returns None on non-zero ranks only
        raise RuntimeError("lm-eval returned no results")
    return {"task": name, "results": out["results"][name], "n_samples": out.get("n-samples", {}).get(name),
            "lm_eval_config": {k: str(v) for k, v in out.get("config", {}).items()}}


def report(dep: Deployment, url: str, limit: int | None, run: dict[str, Any], moe: dict[str, Any],
           versions: dict[str, str]) -> dict[str, Any]:
    results = run["results"]
    score = float(results[METRIC])
    questions = int((run["n_samples"] or {}).get("effective", GSM8K_QUESTIONS))
    published = dep.gsm8k.published if dep.gsm8k else None
    check = verdict(score, published, questions)
    return {
        "benchmark": "gsm8k", "task": run["task"], "num_fewshot": 5, "metric": METRIC,
        "score": score, "stderr": float(results[f"exact_match_stderr,{METRIC.split(',')[1]}"]),
        "strict_match": results.get(STRICT_METRIC), "limit": limit, "questions": questions,
        "published": published, "published_source": dep.gsm8k.source if dep.gsm8k else None,
        "gate": None if published is None else gsm8k_gate(published, questions), "gate_full_run": dep.gate,
        "gate_rule": f"published - {GATE_Z:g} x sqrt(p(1-p)/questions)",
        "status": check.status, "passed": check.passed, "reason": check.reason,
        "config": str(dep.source), "model": dep.model, "backend": dep.backend, "url": url,
        "hardware": dep.hardware.model_dump() if dep.hardware else None,
        "versions": versions, "moe": moe, "lm_eval_results": results,
    }


def markdown(rep: dict[str, Any]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = [f"# gsm8k: {rep['status'].upper()} ({rep['config']})", "",
             "| | |", "|---|---|"]
    for key in ("score", "stderr", "strict_match", "published", "gate", "gate_full_run", "reason", "questions", "task",
                "model", "backend", "url"):
        lines.append(f"| {key} | {fmt(rep[key])} |")
    lines += ["", f"Gate: {rep['gate_rule']} ({rep['published_source'] or 'no published figure'}).", "",
              "## Versions", "", *[f"- {k}: {v}" for k, v in rep["versions"].items()], "",
              "## MoE layers (/v1/moe)", ""]
    layers = rep["moe"].get("layers")
    if layers:
        columns = list(layers[0])
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in layers]
    else:
        lines.append(str(rep["moe"].get("error", "no MoE layers reported")))
    return "\n".join(lines) + "\n"


def _run(dep: Deployment, url: str, args: argparse.Namespace) -> dict[str, Any]:
    from .versions import versions

    run = evaluate(dep, url, args)
    return report(dep, url, args.limit, run, moe_table(url, api_key(dep)), versions())


def run(args: argparse.Namespace) -> int:
    from .builtin_models import ensure_builtin, state_dir
    from .harness import serve

    try:
        dep = load(args.config)
        if args.data_dir:
            offline_task(args.data_dir)  # refuse missing files before a server starts
        if not args.url and dep.nodes.count > 1:
            raise ConfigError(f"{dep.source}: nodes.count: start the {dep.nodes.count} nodes with "
                              f"`moe-overlay serve --role ...` and pass the head's --url")
    except ConfigError as err:
        print(f"moe-overlay eval: error: {err}", file=sys.stderr)
        return 2
    if dep.builtin:
        ensure_builtin(dep.builtin)  # its tokenizer folder is lm-eval's tokenizer
    output = args.output or state_dir() / "eval" / Path(args.config).stem
    output.mkdir(parents=True, exist_ok=True)
    if args.url:
        rep = _run(dep, args.url, args)
    else:
        log = output / "server.log"
        print(f"[moe-overlay eval] starting the server for {args.config} (log: {log})", file=sys.stderr, flush=True)
        with serve(args.config, log, timeout=args.start_timeout, api_key=api_key(dep)) as server:
            rep = _run(dep, server.base_url, args)
    (output / "gsm8k.json").write_text(json.dumps(rep, indent=2, default=str) + "\n")
    text = markdown(rep)
    (output / "gsm8k.md").write_text(text)
    print(text)
    print(f"[moe-overlay eval] reports: {output / 'gsm8k.json'}, {output / 'gsm8k.md'}", file=sys.stderr)
    return 0 if rep["passed"] else 1

