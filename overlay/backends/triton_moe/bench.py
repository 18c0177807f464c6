"""`make bench-gpu`: the Triton backend on the four models' per-GPU layers in one weight
format (`--weights`, `make bench-gpu WEIGHTS=...`), each point set against the hardware floor
measured in the same run and against a peer timed in the same run: torch._grouped_mm for
bf16/fp16, the Triton backend's own bf16 layer for quantised formats (they exist to beat it).

Floor: max(bytes of the experts a routing hits, as stored (packed values and scales) / read
bandwidth, FLOPs / matrix rate of the format's GEMMs: bf16 for bf16, fp16 and mxfp4 (w4a16
computes in 16 bits), fp8 for w8a8). Read bandwidth is the faster of a read-only Triton
kernel over 4 GiB (best of a few shapes, plain loads and, where the GPU has them, tiles through
tensor descriptors) and a device-to-device copy (bytes read + written);
the matrix rates are an 8192-cube GEMM (torch.matmul in bf16, torch._scaled_mm in fp8).
Where the device's published peaks are known (PUBLISHED_PEAKS) a second floor from them is
printed beside it.

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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

import moe_overlay as mo

from ...activations import apply_gated
from ...spec import MoESpec
from ..problems import (
    MODELS,
    ROUTINGS,
    TOKEN_COUNTS,
    WEIGHT_FORMATS,
    floor_for,
    format_models,
    model,
    random_calls,
    random_weights,
    with_weights,
)
from . import launch
from .target import add_target_argument, current_target, use_target
from .timing import graph_replay_seconds, kernel_seconds

COPY_BYTES = 4 * 2**30  # a device-to-device copy of at least 4 GB
READ_BYTES = 4 * 2**30
# (BLOCK, ITERS, warps); the last two added on 2026-12-05, when a tuned Kimi-K3 bf16 layer in target mode
# gfx942 read its weights 0.05% faster than the fastest of the others on an H100
READ_SHAPES = ((4096, 64, 8), (2048, 128, 4), (8192, 32, 16), (4096, 128, 8), (1024, 256, 4), (16384, 16, 16))
# (ROWS, ITERS, warps, stages) of 128-int32 rows through a tensor descriptor, as the kernels read weights
READ_TILE_SHAPES = ((32, 64, 4, 4), (64, 32, 4, 3), (64, 64, 8, 4), (128, 16, 8, 3), (16, 128, 4, 4), (32, 128, 4, 3))
READ_TILE_COLS = 128
# (ROWS, COLS, ITERS, warps, stages) of int8 tiles pipelined into shared memory for a dot, as the GEMMs read
# weights where no descriptor does; added on 2026-12-06, when gfx950's bf16 Kimi-K3 layer at M=128 in target
# mode read its weights 1.3% faster than the plain and descriptor reads on an H200
READ_DOT_SHAPES = ((64, 256, 32, 4, 3), (128, 128, 32, 4, 3), (64, 128, 64, 4, 4), (128, 256, 16, 8, 3))
MATMUL_SIZE = 8192
# Published dense peaks: HBM bytes/s, bf16 and fp8 FLOP/s (no sparsity).
PUBLISHED_PEAKS = {"NVIDIA H200": (4.8e12, 989e12, 1979e12)}


@triton.jit
def _read_kernel(src_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Reads ITERS * BLOCK int32 (xor-folded, so nothing is left out) and writes BLOCK."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(ITERS):
        acc ^= tl.load(src_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _read_tiles_kernel(src_ptr, out_ptr, rows, ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr):
    """_read_kernel through a tensor descriptor over `[rows, COLS]` (bulk copies on Hopper,
    pipelined over num_stages: how the GEMMs stream weight tiles)."""
    desc = tl.make_tensor_descriptor(src_ptr, shape=[rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    first = tl.program_id(0) * ROWS * ITERS
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    for i in range(ITERS):
        acc ^= desc.load([first + i * ROWS, 0])
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + tl.program_id(0) * ROWS * COLS + offs, acc)


@triton.jit
def _read_dot_kernel(src_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, ITERS: tl.constexpr):
    """ITERS `[ROWS, COLS]` int8 tiles summed column by column in an int8 dot with ones, the
    loads pipelined into shared memory over num_stages as the GEMMs' weight tiles are (for sm_90,
    with 16-byte aligned pointers as torch allocates them: asynchronous copies); writes the COLS
    int32 sums."""
    first = tl.program_id(0).to(tl.int64) * ROWS * ITERS
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    ones = tl.full([16, ROWS], 1, tl.int8)
    acc = tl.zeros([16, COLS], dtype=tl.int32)
    for i in range(ITERS):
        acc = tl.dot(ones, tl.load(src_ptr + (first + i * ROWS) * COLS + offs), acc, out_dtype=tl.int32)
    tl.store(out_ptr + tl.program_id(0) * COLS + tl.arange(0, COLS), tl.max(acc, 0))


@dataclass(frozen=True)
class Bandwidth:
    read: float  # bytes/s of the best read-only kernel
    copy: float  # bytes/s of a device-to-device copy, read + written

    @property
    def best(self) -> float:
        return max(self.read, self.copy)


def measure_bandwidth() -> Bandwidth:
    """HBM bytes/s two ways. The copy is timed eagerly: captured in a graph, it becomes a
    memcpy node that ran at ~2.8 TB/s on an H200, against ~4.3 for the same copy launched
    from the stream. A copy alone under-states what reads reach (the first table's Kimi-K3
    M=128 read its weights at 102.5% of it), and so does a read kernel of plain loads: on one
    H200 those read 4.37 TB/s where the bf16 layer's tiles through tensor descriptors read
    4.40, so tiles read that way are timed too, where Triton and the GPU have descriptors, and
    so are tiles pipelined into shared memory for a dot (READ_DOT_SHAPES). The best of all."""
    src = torch.randint(-2**31, 2**31 - 1, (READ_BYTES // 4,), dtype=torch.int32, device="cuda")
    reads = [plain_read(src, *shape) for shape in READ_SHAPES] + [dot_read(src, *shape) for shape in READ_DOT_SHAPES]
    if launch.weight_descriptors(src.view(1, -1, READ_TILE_COLS)):
        reads += [tile_read(src, *shape) for shape in READ_TILE_SHAPES]
    read = max(READ_BYTES / _read_seconds(r) for r in reads)
    del src, reads
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for start, end in marks:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    copy = 2 * COPY_BYTES / (statistics.median(start.elapsed_time(end) for start, end in marks) / 1e3)
    return Bandwidth(read, copy)


def plain_read(src: torch.Tensor, block: int, iters: int, warps: int) -> tuple[Callable[[], None], torch.Tensor]:
    """(a launch of _read_kernel over all of `src`, its output: one xor-folded block a program)."""
    grid = src.numel() // (block * iters)
    out = torch.empty(grid, block, dtype=torch.int32, device=src.device)
    return lambda: _read_kernel[(grid,)](src, out, BLOCK=block, ITERS=iters, num_warps=warps), out


def dot_read(src: torch.Tensor, rows: int, cols: int, iters: int, warps: int,
             stages: int) -> tuple[Callable[[], None], torch.Tensor]:
    """(a launch of _read_dot_kernel over all of `src` as int8, its output: a program's column sums)."""
    data = src.view(torch.int8)
    grid = data.numel() // (rows * cols * iters)
    out = torch.empty(grid, cols, dtype=torch.int32, device=src.device)
    return lambda: _read_dot_kernel[(grid,)](data, out, ROWS=rows, COLS=cols, ITERS=iters, num_warps=warps,
                                             num_stages=stages), out


def tile_read(src: torch.Tensor, rows: int, iters: int, warps: int,
              stages: int) -> tuple[Callable[[], None], torch.Tensor]:
    """(a launch of _read_tiles_kernel over all of `src`, its output: one xor-folded tile a program)."""
    total_rows = src.numel() // READ_TILE_COLS
    grid = total_rows // (rows * iters)
    out = torch.empty(grid, rows, READ_TILE_COLS, dtype=torch.int32, device=src.device)
    launch.install_descriptor_scratch()
    return lambda: _read_tiles_kernel[(grid,)](src, out, total_rows, ROWS=rows, COLS=READ_TILE_COLS, ITERS=iters,
                                               num_warps=warps, num_stages=stages), out


def _read_seconds(read: tuple[Callable[[], None], torch.Tensor]) -> float:
    return graph_replay_seconds(read[0], replays=20)


def measure_matrix_rate(fp8: bool = False) -> float:
    """FLOP/s of an 8192-cube matrix product on random data: bf16, or fp8 e4m3 with unit
    scales through torch._scaled_mm (bf16 output)."""
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        seconds = graph_replay_seconds(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                                       replays=20)
    else:
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
    bound: str
    floor_s: float  # at the measured rates
    peak_floor_s: float | None  # at the published peaks
    triton_s: float
    peer_s: float
    reference_s: float
    triton_err: float
    peer_err: float | None

    @property
    def triton_pct(self) -> float:
        return 100 * self.floor_s / self.triton_s

    @property
    def peer_pct(self) -> float:
        return 100 * self.floor_s / self.peer_s

    @property
    def speedup(self) -> float:
        return self.peer_s / self.triton_s


@dataclass(frozen=True)
class Rates:
    bandwidth: Bandwidth
    bf16: float  # FLOP/s
    fp8: float | None  # FLOP/s, measured for fp8 formats only
    peaks: tuple[float, float, float] | None  # published bytes/s, bf16 and fp8 FLOP/s

    def floor_rates(self, spec: MoESpec, measured: bool) -> tuple[float, float] | None:
        """(bytes/s, FLOP/s) of the floor for `spec`'s format, measured or published."""
        fp8 = spec.quant.weights == "fp8"
        if measured:
            return self.bandwidth.best, (self.fp8 if fp8 else self.bf16)
        if self.peaks is None:
            return None
        return self.peaks[0], self.peaks[2 if fp8 else 1]


def bench_model(name: str, weights: str, tokens: list[int], rates: Rates, explain: bool = False) -> list[Row]:
    base = model(name).spec
    spec = with_weights(base, weights)
    peer_spec = spec if weights in ("bf16", "fp16") else replace(base, dtype=torch.bfloat16)
    tensors = random_weights(spec, "cuda", seed=0)
    # prepare() re-lays out in place (bf16 gate/up interleaved); the peers keep canonical weights
    prepared = mo.PreparedExperts(spec, {k: v.clone() for k, v in tensors.items()}, mo.get_backend("triton"))
    prepared.prepare()
    if peer_spec == spec:
        peer = None
    else:
        peer = mo.PreparedExperts(peer_spec, random_weights(peer_spec, "cuda", seed=0), mo.get_backend("triton"))
        peer.prepare()
    rows = []
    for m in tokens:
        if explain:
            print(f"{name:12s} M={m:5d} plan: {call_plan(prepared, m).describe()}", flush=True)
        rows.append(bench_point(name, spec, tensors, prepared, peer, m, rates, explain))
    del prepared, tensors, peer
    torch.cuda.empty_cache()
    return rows


def bench_point(name: str, spec: MoESpec, tensors: dict[str, torch.Tensor], prepared: mo.PreparedExperts,
                peer: mo.PreparedExperts | None, m: int, rates: Rates, explain: bool = False) -> Row:
    """One point; the peer is `peer`'s Triton layer (bf16), or torch._grouped_mm when None.
    With `explain`, also each kernel's GPU time a call of the Triton layer."""
    calls = random_calls(m, spec, "cuda", ROUTINGS, seed=10)
    x, w, ids = calls[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ref = mo.get_backend("torch").run(spec, tensors, x, w, ids, None)
    end.record()
    torch.cuda.synchronize()
    reference_s = start.elapsed_time(end) / 1e3  # eager: its per-expert nonzero() syncs, no graph
    triton_err = relative_error(prepared.apply(x, w, ids), ref)

    def triton_calls() -> list[torch.Tensor]:
        return [prepared.apply(*c) for c in calls]

    triton_s = graph_replay_seconds(triton_calls) / ROUTINGS
    if explain:
        split = kernel_seconds(triton_calls)
        print(f"{name:12s} M={m:5d} kernels a call: "
              + ", ".join(f"{kernel} {s / ROUTINGS * 1e6:.1f} us" for kernel, s in split.items()), flush=True)
    if peer is None:
        w13_t, w2_t = tensors["w13"].transpose(1, 2), tensors["w2"].transpose(1, 2)  # column-major B, as cuBLAS likes
        peer_err = relative_error(grouped_mm_experts(spec, w13_t, w2_t, x, w, ids), ref)
        peer_s = graph_replay_seconds(lambda: [grouped_mm_experts(spec, w13_t, w2_t, *c) for c in calls]) / ROUTINGS
    else:  # other weights: its error is not comparable to this reference's
        peer_err = None
        peer_s = graph_replay_seconds(lambda: [peer.apply(*c) for c in calls]) / ROUTINGS
    floors = [floor_for(spec, c[2], *rates.floor_rates(spec, measured=True)) for c in calls]
    published = rates.floor_rates(spec, measured=False)
    peak_floor_s = None if published is None else statistics.mean(floor_for(spec, c[2], *published).seconds
                                                                   for c in calls)
    row = Row(name, m, floors[0].bound, statistics.mean(f.seconds for f in floors), peak_floor_s, triton_s, peer_s,
              reference_s, triton_err, peer_err)
    print(f"{name:12s} M={m:5d} floor {row.floor_s * 1e6:9.1f} us ({row.bound}) | triton "
          f"{triton_s * 1e6:9.1f} us {row.triton_pct:5.1f}% | peer {peer_s * 1e6:9.1f} us "
          f"{row.peer_pct:5.1f}% | x{row.speedup:5.2f} | ref {reference_s * 1e3:8.1f} ms | "
          f"err {triton_err:.1e}", flush=True)
    return row


def call_plan(prepared: mo.PreparedExperts, num_tokens: int) -> launch.Plan:
    """The plan the Triton layer `prepared` runs a call of `num_tokens` with."""
    spec, w13 = prepared.spec, prepared.tensors["w13"]
    x = torch.empty(num_tokens, spec.hidden_size, dtype=spec.dtype, device=w13.device)
    layer = launch.Layer.of(x, w13, prepared.tensors["w2"],
                            spec.top_k, spec.activation.kind, list(spec.activation.params),
                            spec.apply_router_weight_on_input, spec.quant.granularity,
                            spec.quant.activations == "fp8_token")
    return launch.call_plan(layer, w13.device, num_tokens)


def versions() -> str:
    import triton

    gpu_runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return f"torch {torch.__version__}, triton {triton.__version__}, {gpu_runtime}, Python {platform.python_version()}"


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values))


def floors_beaten(rows: list[Row], peer: str) -> list[str]:
    """Each layer (Triton's or the peer's) that ran faster than its point's floor, measured or
    at the published peaks: a floor that a kernel beats is not a floor, so the table's
    percentages are not valid until the floor's rates are found wrong and fixed."""
    beaten = []
    for r in rows:
        limit = max(r.floor_s, r.peak_floor_s or 0.0)
        beaten += [f"{r.model} M={r.tokens}: {who} {seconds * 1e6:.1f} us under the floor of {limit * 1e6:.1f} us"
                   for who, seconds in (("triton", r.triton_s), (peer, r.peer_s)) if seconds < limit]
    return beaten


def _peer_name(weights: str) -> str:
    return "_grouped_mm" if weights in ("bf16", "fp16") else "bf16 triton"


def markdown(rows: list[Row], weights: str, device: str, rates: Rates, target: str) -> str:
    worst = min(rows, key=lambda r: r.triton_pct)
    highest = max(rows, key=lambda r: r.triton_pct)
    slowest = min(rows, key=lambda r: r.speedup)
    peer = _peer_name(weights)
    bw = rates.bandwidth
    fp8_rate = f", fp8 matrix rate {rates.fp8 / 1e12:.0f} TFLOP/s (torch._scaled_mm)" if rates.fp8 else ""
    lines = [
        f"Weights: {weights}. Device: {device}. Date: {datetime.date.today().isoformat()}. Versions: {versions()}.",
        f"Kernels: {target}.",
        f"Measured in the same run: read bandwidth {bw.best / 1e12:.2f} TB/s (the faster of a read-only Triton "
        f"kernel over {READ_BYTES / 1e9:.1f} GB (plain loads, tiles pipelined for a dot, or descriptor tiles, "
        f"the best shape), "
        f"{bw.read / 1e12:.2f} TB/s, and a device-to-device copy, "
        f"{bw.copy / 1e12:.2f} TB/s read + written), bf16 matrix rate {rates.bf16 / 1e12:.0f} TFLOP/s "
        f"({MATMUL_SIZE}-cube GEMM){fp8_rate}.",
    ]
    if rates.peaks:
        peak_bw, peak_bf16, peak_fp8 = rates.peaks
        lines.append(f"Published peaks (second floor column): {peak_bw / 1e12:.1f} TB/s, bf16 {peak_bf16 / 1e12:.0f} "
                     f"and fp8 {peak_fp8 / 1e12:.0f} TFLOP/s dense.")
    lines += [
        "",
        f"| model | M | floor (us) | bound | floor at peaks (us) | triton (us) | % of floor | % of peak floor "
        f"| {peer} (us) | % of floor | {peer} / triton | reference (ms) | rel. err triton / {peer} |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        peak = "—" if r.peak_floor_s is None else f"{r.peak_floor_s * 1e6:.1f}"
        peak_pct = "—" if r.peak_floor_s is None else f"{100 * r.peak_floor_s / r.triton_s:.1f}%"
        peer_err = "—" if r.peer_err is None else f"{r.peer_err:.1e}"
        lines.append(
            f"| {r.model} | {r.tokens} | {r.floor_s * 1e6:.1f} | {r.bound} | {peak} | {r.triton_s * 1e6:.1f} "
            f"| {r.triton_pct:.1f}% | {peak_pct} | {r.peer_s * 1e6:.1f} | {r.peer_pct:.1f}% | {r.speedup:.2f}x "
            f"| {r.reference_s * 1e3:.1f} | {r.triton_err:.1e} / {peer_err} |")
    peak_summary = ""
    if all(r.peak_floor_s is not None for r in rows):
        peak_summary = (f" (of the floor at published peaks: "
                        f"{_geomean([100 * r.peak_floor_s / r.triton_s for r in rows]):.1f}%)")
    lines += [
        "",
        f"Triton: geometric mean {_geomean([r.triton_pct for r in rows]):.1f}% of the floor{peak_summary}, lowest "
        f"{worst.triton_pct:.1f}% ({worst.model} M={worst.tokens}), highest {highest.triton_pct:.1f}% "
        f"({highest.model} M={highest.tokens}); against {peer}: geometric mean "
        f"{_geomean([r.speedup for r in rows]):.2f}x faster, lowest {slowest.speedup:.2f}x ({slowest.model} "
        f"M={slowest.tokens}), faster at {sum(r.speedup > 1 for r in rows)} of {len(rows)} points.",
    ]
    beaten = floors_beaten(rows, peer)
    if beaten:
        lines += ["", f"**Floor beaten by {len(beaten)} layer(s), so it is wrong and the percentages above are not "
                  f"valid:** {'; '.join(beaten)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS,
                        help="the weights' format (default bf16); fp8-*: w8a8, mxfp4: w4a16")
    parser.add_argument("--model", action="append", choices=[m.name for m in MODELS],
                        help="default: the models whose checkpoints ship the format (all four for bf16/fp16)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    add_target_argument(parser)
    parser.add_argument("--explain", action="store_true",
                        help="also print each point's plan (the kernel and tiles of each step) and each "
                             "kernel's GPU time a call")
    args = parser.parse_args(argv)
    use_target(args.target, args.unit_programs)
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA or ROCm GPU")
        return 1
    device = torch.cuda.get_device_name()
    target = current_target().describe()
    print(f"kernels: {target}", flush=True)
    fp8 = args.weights.startswith("fp8")
    rates = Rates(measure_bandwidth(), measure_matrix_rate(), measure_matrix_rate(fp8=True) if fp8 else None,
                  PUBLISHED_PEAKS.get(device))
    bw = rates.bandwidth
    print(f"{device}: read {bw.read / 1e12:.2f} TB/s, copy {bw.copy / 1e12:.2f} TB/s, bf16 {rates.bf16 / 1e12:.0f} "
          f"TFLOP/s" + (f", fp8 {rates.fp8 / 1e12:.0f} TFLOP/s" if rates.fp8 else "") + f"; {versions()}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    names = args.model or list(format_models(args.weights))
    rows = [row for name in names for row in bench_model(name, args.weights, tokens, rates, args.explain)]
    table = markdown(rows, args.weights, device, rates, target)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if floors_beaten(rows, _peer_name(args.weights)):
        print("a layer ran faster than its floor: the measured rates under-state this GPU (see the table's last line)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
