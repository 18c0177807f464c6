"""Check the AITER backend on a real MI300X/MI325X (gfx942) or MI350X/MI355X (gfx950):
run it against the torch reference for the four models' MoE layers (per-GPU shapes under
TP8, random weights in each model's quantisation) and print max errors and timings.

    python -m moe_overlay.backends.aiter.check [--tokens 1,32,512] [--iters 20] [--models kimi,...]

The first call of each case builds AITER's kernels (AITER compiles on first use: minutes).
Exit status: 0 when every case that can run here is within its tolerance, 1 when one is not
(or raised), 2 without an AMD GPU. Cases this GPU or AITER cannot run are listed as skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ...backend import Backend, Platform, get_backend, select_backend
from ...errors import BackendUnavailableError
from ...prepared import PreparedExperts
from ...routing import grouped_topk, sigmoid_top1, softmax_topk
from ...spec import MoESpec, QuantSpec
from ..problems import model, random_weights

Router = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (logits, top_k) -> routing


def _bias(logits: torch.Tensor) -> torch.Tensor:
    return torch.linspace(-0.05, 0.05, logits.shape[1], device=logits.device)  # a fixed correction bias


def _mixtral(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return softmax_topk(logits, k)


def _deepseek_v3(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_topk(logits, k, 8, 4, correction_bias=_bias(logits), routed_scaling_factor=2.5)


def _kimi(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_topk(logits, k, 1, 1, correction_bias=_bias(logits))


@dataclass(frozen=True)
class Case:
    model: str
    spec: MoESpec
    route: Router
    tolerance: float  # on max |aiter - torch| / max |torch|


FP8_BLOCK = QuantSpec("fp8", "block", (128, 128), activations="fp8_block")
FP8_TOKEN = QuantSpec("fp8", "channel", activations="fp8_token")
FP8_TENSOR = QuantSpec("fp8", "tensor", activations="fp8_tensor")
# fp8 activations on both sides, quantised on different grids on gfx942 (e4m3fnuz vs e4m3fn):
# their errors do not cancel.
FP8_TOLERANCE, BF16_TOLERANCE = 0.12, 0.03

MIXTRAL, DEEPSEEK, MAVERICK, KIMI = (model(name).spec for name in ("Mixtral", "DeepSeek-V3", "Maverick", "Kimi-K3"))
CASES = (
    Case("Mixtral-8x7B", MIXTRAL, _mixtral, BF16_TOLERANCE),
    Case("Mixtral-8x7B", replace(MIXTRAL, quant=FP8_TENSOR), _mixtral, FP8_TOLERANCE),
    Case("DeepSeek-V3", replace(DEEPSEEK, quant=FP8_BLOCK), _deepseek_v3, FP8_TOLERANCE),
    Case("Llama-4-Maverick", MAVERICK, sigmoid_top1, BF16_TOLERANCE),
    Case("Llama-4-Maverick", replace(MAVERICK, quant=FP8_TOKEN), sigmoid_top1, FP8_TOLERANCE),
    Case("Kimi-K3", replace(KIMI, quant=QuantSpec("mxfp4")), _kimi, BF16_TOLERANCE),
)


def _timed_ms(fn: Callable[[], torch.Tensor], iters: int, device: torch.device) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@dataclass(frozen=True)
class Result:
    case: Case
    tokens: int
    kernel: str
    max_error: float = float("nan")
    relative_error: float = float("nan")
    backend_ms: float = float("nan")
    reference_ms: float = float("nan")
    skipped: str | None = None  # why the backend cannot run the case here
    error: str | None = None  # what it raised when it tried

    @property
    def ok(self) -> bool:
        return self.skipped is None and self.error is None and self.relative_error <= self.case.tolerance

    @property
    def verdict(self) -> str:
        if self.skipped is not None:
            return f"SKIPPED: {self.skipped}"
        if self.error is not None:
            return f"ERROR: {self.error}"
        return "ok" if self.ok else "FAIL"


def check_case(case: Case, backend: Backend, device: torch.device, tokens: Sequence[int], iters: int,
               seed: int = 0) -> list[Result]:
    spec = case.spec
    tensors = random_weights(spec, device, seed, gain=1.0)
    reference = PreparedExperts(spec, {k: v.clone() for k, v in tensors.items()}, get_backend("torch"))
    experts = PreparedExperts(spec, tensors, backend)
    experts.prepare()
    kernel = backend.kernel_name(spec)
    gen = torch.Generator(device).manual_seed(seed + 1)
    results = []
    for m in tokens:
        x = torch.randn(m, spec.hidden_size, generator=gen, device=device).to(spec.dtype)
        weights, ids = case.route(torch.randn(m, spec.num_experts, generator=gen, device=device), spec.top_k)
        expected = reference.apply(x, weights, ids).float()
        got = experts.apply(x, weights, ids).float()
        error = (got - expected).abs().max().item()
        results.append(Result(
            case, m, kernel, error, error / max(expected.abs().max().item(), 1e-30),
            _timed_ms(lambda: experts.apply(x, weights, ids), iters, device),  # noqa: B023 (timed now)
            _timed_ms(lambda: reference.apply(x, weights, ids), 1, device),  # noqa: B023
        ))
    return results


def run_checks(cases: Sequence[Case], device: torch.device, tokens: Sequence[int], iters: int,
               backend: Backend | None = None) -> list[Result]:
    """Every case on `backend` (default: the AITER backend, if selection allows it here)."""
    results: list[Result] = []
    platform = Platform.of(device)
    for case in cases:
        try:
            chosen = backend or select_backend(case.spec, platform, "aiter", strict=True).backend
        except BackendUnavailableError as why:
            results.append(Result(case, 0, "-", skipped=str(why)))
            continue
        try:
            results.extend(check_case(case, chosen, device, tokens, iters))
        except Exception as exc:  # one broken case must not hide the others' results
            results.append(Result(case, 0, chosen.kernel_name(case.spec), error=f"{type(exc).__name__}: {exc}"))
    return results


def format_table(results: Sequence[Result]) -> str:
    header = ("model", "AITER path", "tokens", "max err", "rel err", "tol", "aiter ms", "torch ms", "result")
    rows = [header]
    for r in results:
        if r.skipped is not None or r.error is not None:
            rows.append((r.case.model, r.kernel if r.error else str(r.case.spec.quant), *"------", r.verdict))
            continue
        rows.append((r.case.model, r.kernel, str(r.tokens), f"{r.max_error:.3g}", f"{r.relative_error:.3g}",
                     f"{r.case.tolerance:g}", f"{r.backend_ms:.3f}", f"{r.reference_ms:.1f}", r.verdict))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]])
                     for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_overlay.backends.aiter.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,32,512", help="batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20, help="timed AITER calls per batch size (default: %(default)s)")
    parser.add_argument("--models", default="", help="only models whose name contains one of these (comma-separated)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    if not torch.cuda.is_available() or torch.version.hip is None:
        where = "no GPU" if not torch.cuda.is_available() else f"a {Platform.of(device)} GPU"
        print(f"the AITER check needs an AMD GPU with ROCm (MI300X/MI325X or MI350X/MI355X); this machine has {where}")
        return 2
    wanted = [w.strip().lower() for w in args.models.split(",") if w.strip()]
    cases = [c for c in CASES if not wanted or any(w in c.model.lower() for w in wanted)]
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"AITER backend vs torch reference on {Platform.of(device)} ({torch.cuda.get_device_name(device)})")
    results = []
    for case in cases:
        print(f"  {case.model}, {case.spec.quant} ...", flush=True)
        results.extend(run_checks([case], device, tokens, args.iters))
    print(format_table(results))
    return 0 if all(r.ok for r in results if r.skipped is None) else 1


if __name__ == "__main__":
    sys.exit(main())
