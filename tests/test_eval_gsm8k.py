"""`moe-overlay eval gsm8k`: the shipped offline task is lm-eval's own gsm8k on local files, the gate
logic on made-up scores, and the whole pipeline (server, lm-eval local-completions, reports,
exit status) on the tiny model with a few questions of ../shared/data/gsm8k."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lm_eval.tasks
import pytest
import yaml

from moe_overlay.serving.config import gsm8k_gate
from moe_overlay.serving.eval_gsm8k import OFFLINE_TASK_FILE, offline_task, verdict
from moe_overlay.serving.harness import serve

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-mixtral.yaml"
GSM8K_DIR = ROOT.parent / "shared" / "data" / "gsm8k"
LM_EVAL_GSM8K = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
DATA_SOURCE_KEYS = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs"}
LIMIT = 5

needs_data = pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").is_file(), reason=f"no GSM8K JSONL in {GSM8K_DIR}")


def test_offline_task_is_lm_evals_gsm8k_but_for_the_data_source():
    ours = yaml.safe_load(OFFLINE_TASK_FILE.read_text())
    theirs = yaml.safe_load(LM_EVAL_GSM8K.read_text())
    assert {k: v for k, v in ours.items() if k not in DATA_SOURCE_KEYS} == \
        {k: v for k, v in theirs.items() if k not in DATA_SOURCE_KEYS}
    assert ours["dataset_path"] == "json" and theirs["dataset_path"] == "openai/gsm8k"


@needs_data
def test_documents_render_and_score_the_same_both_ways():
    """lm-eval's own gsm8k.yaml pointed at the same local files vs the shipped task: the same
    5-shot prompts (same few-shot seed), targets, stop sequences, and scores of the same answers."""
    from lm_eval.tasks import TaskManager

    ours = offline_task(GSM8K_DIR)
    theirs = yaml.safe_load(LM_EVAL_GSM8K.read_text())
    theirs.update(task="gsm8k_lm_eval_local", dataset_path="json", dataset_kwargs=ours["dataset_kwargs"])
    del theirs["dataset_name"], theirs["tag"]
    tasks = TaskManager().load([ours, theirs])["tasks"]
    a, b = tasks["gsm8k_offline"], tasks["gsm8k_lm_eval_local"]
    for task in (a, b):
        task.set_fewshot_seed(seed=1234)
    docs_a, docs_b = list(a.test_docs())[:4], list(b.test_docs())[:4]
    assert docs_a == docs_b
    for doc in docs_a:
        prompt = a.fewshot_context(doc, num_fewshot=5)
        assert prompt == b.fewshot_context(doc, num_fewshot=5) and prompt.count("Question:") == 6
        assert a.doc_to_target(doc) == b.doc_to_target(doc)
    assert a.config.generation_kwargs == b.config.generation_kwargs
    answer = docs_a[0]["answer"].split("#### ")[-1]
    replies = [f"So the answer is {answer}.", f"#### {answer}", "I do not know", f"{answer}0"]
    for reply in replies:
        for filtered in ("strict-match", "flexible-extract"):
            assert _score(a, docs_a[0], reply, filtered) == _score(b, docs_b[0], reply, filtered)
    assert _score(a, docs_a[0], replies[0], "flexible-extract") == 1.0
    assert _score(a, docs_a[0], replies[2], "flexible-extract") == 0.0


def _score(task, doc, reply: str, filter_name: str) -> float:
    """lm-eval's own filter pipeline and metric on one reply (the attributes FilterEnsemble reads)."""
    instance = SimpleNamespace(resps=[reply], doc=doc, filtered_resps={})
    next(f for f in task._filters if f.name == filter_name).apply([instance])
    return task.process_results(doc, [instance.filtered_resps[filter_name]])["exact_match"]


@pytest.mark.parametrize(
    "score,published,questions,status",
    [
        (0.95, 0.9553, 1319, "pass"),
        (gsm8k_gate(0.9553), 0.9553, 1319, "pass"),  # exactly at the gate
        (gsm8k_gate(0.9553) - 1e-4, 0.9553, 1319, "fail"),
        (0.90, 0.9553, 1319, "fail"),
        (0.90, 0.9553, 100, "pass"),  # 100 questions: gate 0.8933
        (0.0, 0.9553, 5, "fail"),
        (0.0, None, 1319, "not gated"),
    ],
)
def test_gate_on_made_up_scores(score, published, questions, status):
    result = verdict(score, published, questions)
    assert result.status == status and result.passed == (status != "fail")


KEY = "eval-test-key-not-for-reports"


def _tiny_config(folder: Path, **sections) -> Path:
    """The tiny Mixtral behind an API key (lm-eval and /v1/moe must send it, the reports never)."""
    raw = yaml.safe_load(TINY.read_text())
    raw["server"]["api_key"] = KEY
    raw.update(sections)
    path = folder / "tiny-keyed.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    with serve(_tiny_config(folder), folder / "server.log", api_key=KEY) as server:
        yield server


def _eval(config: Path, url: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_overlay.cli", "eval", "gsm8k", str(config), "--url", url, "--limit", str(LIMIT),
         "--data-dir", str(GSM8K_DIR), "--output", str(out), "--concurrency", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)


@needs_data
def test_pipeline_writes_reports_without_a_gate(tiny_server, tmp_path):
    result = _eval(_tiny_config(tmp_path), tiny_server.base_url, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    rep = json.loads((tmp_path / "out" / "gsm8k.json").read_text())
    assert rep["status"] == "not gated" and rep["questions"] == LIMIT and rep["task"] == "gsm8k_offline"
    assert 0.0 <= rep["score"] <= 1.0 and rep["stderr"] >= 0.0 and rep["versions"]["lm-eval"] == "0.4.13"
    layers = rep["moe"]["layers"]
    assert len(layers) == 2 and {row["backend"] for row in layers} == {"torch"}
    markdown = (tmp_path / "out" / "gsm8k.md").read_text()
    assert markdown.startswith("# gsm8k: NOT GATED") and "moe_overlay::reference_experts" in markdown
    assert "Requesting API" in result.stderr  # lm-eval's own progress display
    for text in (markdown, (tmp_path / "out" / "gsm8k.json").read_text(), result.stdout, result.stderr):
        assert KEY not in text


@needs_data
def test_pipeline_exits_non_zero_below_the_gate(tiny_server, tmp_path):
    config = _tiny_config(tmp_path, gsm8k={"published": 0.9553, "source": "made up for this test"})
    result = _eval(config, tiny_server.base_url, tmp_path / "out")
    rep = json.loads((tmp_path / "out" / "gsm8k.json").read_text())
    assert rep["gate"] == pytest.approx(gsm8k_gate(0.9553, LIMIT)) and rep["gate_full_run"] == gsm8k_gate(0.9553)
    assert rep["score"] < rep["gate"]  # the random tiny model answers nothing right
    assert result.returncode == 1 and rep["status"] == "fail" and not rep["passed"]


def test_missing_data_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moe_overlay.cli", "eval", "gsm8k", str(TINY), "--data-dir",
                             str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    expected = f"moe-overlay eval: error: {tmp_path}: no train.jsonl (train split of GSM8K as JSONL)"
    assert result.stderr.strip() == expected


def test_make_eval_gsm8k_passes_its_variables():
    result = subprocess.run(["make", "-n", "eval-gsm8k", "CONFIG=configs/x.yaml",
                             "URL=http://h:1", "LIMIT=7", "GSM8K_DIR=/data/gsm8k"],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    command = " ".join(result.stdout.replace("\\\n", " ").split())
    assert "moe-overlay eval gsm8k configs/x.yaml --url http://h:1 --limit 7 --data-dir /data/gsm8k" in command
