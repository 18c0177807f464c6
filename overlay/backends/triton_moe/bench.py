"""`make bench-gpu`: the Triton backend against torch._grouped_mm and the torch reference on
the four models' per-GPU layers, each time set against the hardware floor measured in the
same run.

Routing: each token picks top_k distinct experts uniformly at random (seeded). Each timed
call runs ROUTINGS different routings back to back inside one CUDA graph, so weights a
call reuses are not still in the L2 from the call before; times are per routing.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import moe_overlay as mo

from ...activations import apply_gated
from ...spec import MoESpec
from ..problems import MODELS, ROUTINGS, TOKEN_COUNTS, Floor, floor_for, model, random_calls, random_weights
from .timing import graph_replay_seconds

COPY_BYTES = 4 * 2**30  # a device-to-device copy of at least 4 GB
MATMUL_SIZE = 8192


def measure_bandwidth() -> float:
    """HBM bytes/s of a device-to-device copy, counting bytes read and bytes written. Timed
    eagerly: captured in a graph, the copy becomes a memcpy node that ran at ~2.8 TB/s on
    an H200, against ~4.3 for the same copy launched from the stream."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for start, end in marks:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    return 2 * COPY_BYTES / (statistics.median(start.elapsed_time(end) for start, end in marks) / 1e3)


def measure_matrix_rate() -> float:
    """bf16 FLOP/s of an 8192-cube matrix product on random data."""
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = graph_replay_seconds(lambda: a @ b, replays=20)
    return 2 * MATMUL_SIZE**3 / seconds


def grouped_mm_experts(spec: MoESpec, w13_t: torch.Tensor, w2_t: torch.Tensor, x: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE layer from PyTorch's grouped GEMM: sort routes by expert, gather, two grouped
    GEMMs around the activation, weight, un-sort, sum over top-k."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(1, spec.num_experts + 1, device=x.device, dtype=flat.dtype))
    ends = ends.to(torch.int32)
    route_weights = topk_weights.reshape(-1)[order, None]
    h = x[order // top_k]
    if spec.apply_router_weight_on_input:
        h = (h * route_weights).to(x.dtype)
    gate_up = torch._grouped_mm(h, w13_t, offs=ends)
    y = torch._grouped_mm(apply_gated(spec.activation, gate_up).to(x.dtype), w2_t, offs=ends)
    if not spec.apply_router_weight_on_input:
        y = (y * route_weights).to(x.dtype)
    return y.new_empty(y.shape).index_copy_(0, order, y).view(num_tokens, top_k, -1).sum(dim=1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@dataclass
class Row:
    model: str
    tokens: int
    floor: Floor
    floor_s: float
    triton_s: float
    grouped_s: float
    reference_s: float
    triton_err: float
    grouped_err: float

    @property
    def triton_pct(self) -> float:
        return 100 * self.floor_s / self.triton_s

    @property
    def grouped_pct(self) -> float:
        return 100 * self.floor_s / self.grouped_s

    @property
    def speedup(self) -> float:
        return self.grouped_s / self.triton_s


def bench_model(name: str, spec: MoESpec, tokens: list[int], bandwidth: float, rate: float) -> list[Row]:
    tensors = random_weights(spec, "cuda", seed=0)
    # prepare() re-lays out in place (gate/up interleaved); the peers keep canonical weights
    prepared = mo.PreparedExperts(spec, {k: v.clone() for k, v in tensors.items()}, mo.get_backend("triton"))
    prepared.prepare()
    rows = [bench_point(name, spec, tensors, prepared, m, bandwidth, rate) for m in tokens]
    del prepared, tensors
    torch.cuda.empty_cache()
    return rows


def bench_point(name: str, spec: MoESpec, tensors: dict[str, torch.Tensor], prepared: mo.PreparedExperts, m: int,
                bandwidth: float, rate: float) -> Row:
    w13_t, w2_t = tensors["w13"].transpose(1, 2), tensors["w2"].transpose(1, 2)  # column-major B, as cuBLAS likes
    calls = random_calls(m, spec, "cuda", ROUTINGS, seed=10)
    x, w, ids = calls[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ref = mo.get_backend("torch").run(spec, tensors, x, w, ids, None)
    end.record()
    torch.cuda.synchronize()
    reference_s = start.elapsed_time(end) / 1e3  # eager: its per-expert nonzero() syncs, no graph
    triton_err = relative_error(prepared.apply(x, w, ids), ref)
    grouped_err = relative_error(grouped_mm_experts(spec, w13_t, w2_t, x, w, ids), ref)
    triton_s = graph_replay_seconds(lambda: [prepared.apply(*c) for c in calls]) / ROUTINGS
    grouped_s = graph_replay_seconds(lambda: [grouped_mm_experts(spec, w13_t, w2_t, *c) for c in calls]) / ROUTINGS
    floors = [floor_for(spec, c[2], bandwidth, rate) for c in calls]
    row = Row(name, m, floors[0], statistics.mean(f.seconds for f in floors), triton_s, grouped_s, reference_s,
              triton_err, grouped_err)
    print(f"{name:12s} M={m:5d} floor {row.floor_s * 1e6:9.1f} us ({row.floor.bound}) | triton "
          f"{triton_s * 1e6:9.1f} us {row.triton_pct:5.1f}% | _grouped_mm {grouped_s * 1e6:9.1f} us "
          f"{row.grouped_pct:5.1f}% | x{row.speedup:5.2f} | ref {reference_s * 1e3:8.1f} ms | "
          f"err {triton_err:.1e} / {grouped_err:.1e}", flush=True)
    return row


def versions() -> str:
    import triton

    gpu_runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return f"torch {torch.__version__}, triton {triton.__version__}, {gpu_runtime}, Python {platform.python_version()}"


def markdown(rows: list[Row], device: str, bandwidth: float, rate: float) -> str:
    geo = math.exp(statistics.mean(math.log(r.triton_pct) for r in rows))
    worst = min(rows, key=lambda r: r.triton_pct)
    ratio = math.exp(statistics.mean(math.log(r.speedup) for r in rows))
    slowest = min(rows, key=lambda r: r.speedup)
    lines = [
        f"Device: {device}. Date: {datetime.date.today().isoformat()}. Versions: {versions()}.",
        f"Measured in the same run: HBM {bandwidth / 1e12:.2f} TB/s (device-to-device copy of "
        f"{COPY_BYTES / 1e9:.1f} GB, bytes read + written), bf16 matrix rate {rate / 1e12:.0f} TFLOP/s "
        f"({MATMUL_SIZE}-cube GEMM).",
        "",
        "| model | M | floor (us) | bound | triton (us) | % of floor | _grouped_mm (us) | % of floor "
        "| _grouped_mm / triton | reference (ms) | rel. err triton / _grouped_mm |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.tokens} | {r.floor_s * 1e6:.1f} | {r.floor.bound} | {r.triton_s * 1e6:.1f} "
            f"| {r.triton_pct:.1f}% | {r.grouped_s * 1e6:.1f} | {r.grouped_pct:.1f}% | {r.speedup:.2f}x "
            f"| {r.reference_s * 1e3:.1f} | {r.triton_err:.1e} / {r.grouped_err:.1e} |")
    lines += [
        "",
        f"Triton: geometric mean {geo:.1f}% of the floor, lowest {worst.triton_pct:.1f}% ({worst.model} "
        f"M={worst.tokens}); against torch._grouped_mm: geometric mean {ratio:.2f}x faster, "
        f"lowest {slowest.speedup:.2f}x ({slowest.model} M={slowest.tokens}), faster at "
        f"{sum(r.speedup > 1 for r in rows)} of {len(rows)} points.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=[m.name for m in MODELS], help="default: all four")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA or ROCm GPU")
        return 1
    device = torch.cuda.get_device_name()
    bandwidth, rate = measure_bandwidth(), measure_matrix_rate()
    print(f"{device}: HBM {bandwidth / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s; {versions()}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [row for name in args.model or [m.name for m in MODELS]
            for row in bench_model(name, model(name).spec, tokens, bandwidth, rate)]
    table = markdown(rows, device, bandwidth, rate)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
