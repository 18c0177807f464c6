"""AITER's own reference maths and layout code, loaded from the installed amd-aiter files.

`aiter_reference(arch)` gathers, without importing `aiter`: its dtypes for that GPU (its
`dtypes.py`, told the arch), its enums (parsed from its C++ header), its torch quantisers
and activations (`ops/quant.py`), its mxfp4 decoders (`utility/fp4_utils.py`), its torch
reference for the two fused-MoE stages (`fused_moe.py`), its torch grouped top-k
(`ops/topk.py`) and its weight and scale shuffles (`ops/shuffle.py`, plain torch).
"""

from __future__ import annotations

import enum
import functools
from types import SimpleNamespace

from .sources import ENUM_HEADERS, installed_root, load_definitions, load_file, parse_enums


def _enums() -> dict[str, type[enum.IntEnum]]:
    header = (installed_root() / ENUM_HEADERS[0]).read_text()
    return {name: enum.IntEnum(name, members) for name, members in parse_enums(header).items()}


@functools.cache
def aiter_reference(arch: str) -> SimpleNamespace:
    enums = _enums()
    dtypes = load_definitions("aiter/utility/dtypes.py", None, {"get_gfx": lambda: arch})
    fp4_utils = load_definitions("aiter/utility/fp4_utils.py", ["mxfp4_to_f32", "e8m0_to_f32"], {"dtypes": dtypes})
    quant = load_definitions(
        "aiter/ops/quant.py",
        ["get_dtype_max", "pertoken_quant", "per_tensor_quant", "per_1x32_f4_quant", "per_block_quant_wrapper",
         "get_torch_quant", "get_torch_act"],
        {"dtypes": dtypes, "fp4_utils": fp4_utils, **enums},
    )
    aiter = SimpleNamespace(get_torch_act=quant.get_torch_act, **enums)  # what `aiter.` means in fused_moe.py
    stages = load_definitions(
        "aiter/fused_moe.py",
        ["get_inter_dim", "quant_remap", "torch_moe_stage1", "torch_moe_stage2"],
        {"aiter": aiter, "dtypes": dtypes, "fp4_utils": fp4_utils, **enums},
    )
    topk = load_definitions("aiter/ops/topk.py", ["biased_grouped_topk_torch"], {"dtypes": dtypes})
    return SimpleNamespace(
        arch=arch, dtypes=dtypes, fp4_utils=fp4_utils, quant=quant, stages=stages, topk=topk,
        shuffle=load_file("aiter/ops/shuffle.py"), **enums,
    )
