"""The MI300X/MI355X self-check script, run here on CPU against the AITER emulator."""

import dataclasses

import torch

from moe_overlay.backends.aiter import check as aiter_check
from tests.aiter_emulator.layers import emulated_backend

# The four models' MoE layers per GPU under TP8: (hidden, intermediate, experts, top-k)
PER_GPU_SHAPES = {
    "Mixtral-8x7B": (4096, 1792, 8, 2),
    "DeepSeek-V3": (7168, 256, 256, 8),
    "Llama-4-Maverick": (5120, 1024, 128, 1),
    "Kimi-K3": (3584, 384, 896, 16),
}


def _small(case: aiter_check.Case) -> aiter_check.Case:
    spec = dataclasses.replace(case.spec, num_experts=8, hidden_size=256, intermediate_size=128,
                               top_k=min(case.spec.top_k, 4))
    return dataclasses.replace(case, spec=spec)


def test_cases_are_the_four_models_per_gpu():
    shapes = {(c.model, (c.spec.hidden_size, c.spec.intermediate_size, c.spec.num_experts, c.spec.top_k))
              for c in aiter_check.CASES}
    assert shapes == set(PER_GPU_SHAPES.items())
    quants: dict[str, set[str]] = {}
    for c in aiter_check.CASES:
        quants.setdefault(c.model, set()).add(str(c.spec.quant))
    assert quants["Kimi-K3"] == {"mxfp4 (e2m1, e8m0 scale per 32)"}
    assert any("block128x128" in q for q in quants["DeepSeek-V3"])


def test_every_case_passes_through_the_emulated_backend_and_prints_a_table():
    backend, emulator = emulated_backend("gfx950")
    cases = [_small(c) for c in aiter_check.CASES]
    results = aiter_check.run_checks(cases, torch.device("cpu"), [5], 1, backend)
    assert [r.case.model for r in results] == [c.model for c in cases]
    assert all(r.ok for r in results), aiter_check.format_table(results)
    assert {c[0] for c in emulator.calls} == {"fused_moe"}
    table = aiter_check.format_table(results).splitlines()
    assert table[0].split()[:3] == ["model", "AITER", "path"] and len(table) == 1 + len(cases)
    assert "aiter.fused_moe(per_1x32, Situv2) [mxfp4 a16w4]" in table[-1] and table[-1].endswith("ok")


def test_a_wrong_result_fails_the_check():
    case = _small(aiter_check.CASES[0])
    backend, emulator = emulated_backend("gfx942")

    class Doubling(type(backend)):  # the backend sees doubled routing weights; the reference does not
        def run(self, spec, tensors, x, topk_weights, topk_ids, expert_map):
            return super().run(spec, tensors, x, topk_weights * 2, topk_ids, expert_map)

    doubled = Doubling(emulator)
    [result] = aiter_check.run_checks([case], torch.device("cpu"), [4], 1, doubled)
    assert not result.ok and result.relative_error > 0.4
    assert aiter_check.format_table([result]).splitlines()[1].endswith("FAIL")


def test_a_case_that_raises_is_an_error_row_and_the_others_still_run():
    backend, emulator = emulated_backend("gfx950")
    cases = [_small(c) for c in aiter_check.CASES[:2]]

    class Broken(type(backend)):
        def run(self, spec, tensors, x, topk_weights, topk_ids, expert_map):
            if spec.quant.weights == "none":
                raise RuntimeError("no kernel for this shape")
            return super().run(spec, tensors, x, topk_weights, topk_ids, expert_map)

    broken, fine = aiter_check.run_checks(cases, torch.device("cpu"), [3], 1, Broken(emulator))
    assert broken.verdict == "ERROR: RuntimeError: no kernel for this shape" and not broken.ok
    assert fine.ok and fine.case is cases[1]
    assert aiter_check.format_table([broken]).splitlines()[1].endswith("ERROR: RuntimeError: no kernel for this shape")


def test_unsupported_cases_are_skipped_with_the_reason():
    results = aiter_check.run_checks([_small(aiter_check.CASES[-1])], torch.device("cpu"), [1], 1)
    why = "no requested backend can run this layer on cpu: aiter: needs ROCm (AMD GPU); this is cpu"
    assert results[0].skipped == why and not results[0].ok
    assert f"SKIPPED: {why}" in aiter_check.format_table(results)


def test_main_without_an_amd_gpu_says_so(capsys):
    assert aiter_check.main(["--tokens", "1"]) == 2
    assert "needs an AMD GPU with ROCm (MI300X/MI325X or MI350X/MI355X); this machine has no GPU" in (
        capsys.readouterr().out)
