"""Independent plain-loop implementations the adapter is checked against.

Deliberately written differently from the product code: per token, per expert, Python
scalars where that is cheap, formats decoded from their bit definitions.
"""

from __future__ import annotations

import math

import torch


def loop_topk(row: list[float], k: int) -> list[int]:
    """Indices of the k largest values, ties to the lower index."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def loop_softmax_topk(logits: torch.Tensor, k: int, renormalize: bool):
    weights, ids = [], []
    for row in logits.double().tolist():
        m = max(row)
        exps = [math.exp(v - m) for v in row]
        probs = [e / sum(exps) for e in exps]
        chosen = loop_topk(probs, k)
        w = [probs[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


def loop_grouped_topk(logits, k, n_group, topk_group, bias, renormalize, scale):
    weights, ids = [], []
    bias_l = bias.double().tolist() if bias is not None else None
    for row in logits.double().tolist():
        scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + bias_l[i] for i, s in enumerate(scores)] if bias_l else list(scores)
        size = len(row) // n_group
        group_score = []
        for g in range(n_group):
            members = sorted(choice[g * size : (g + 1) * size], reverse=True)
            group_score.append(sum(members[:2]))
        kept = set(loop_topk(group_score, topk_group))
        masked = [c if i // size in kept else -math.inf for i, c in enumerate(choice)]
        chosen = loop_topk(masked, k)
        w = [scores[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append([v * scale for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


def loop_sigmoid_top1(logits, k):
    weights, ids = [], []
    for row in logits.double().tolist():
        chosen = loop_topk(row, k)
        weights.append([1.0 / (1.0 + math.exp(-row[i])) for i in chosen])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids)


# -- formats, decoded from their definitions ------------------------------------------------


def decode_e2m1(code: int) -> float:
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 0b1
    if exp == 0:
        return sign * man * 0.5  # subnormal: 0 or 0.5
    return sign * 2.0 ** (exp - 1) * (1.0 + man / 2.0)


def loop_dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert: uint8 [N, K/2], e8m0 [N, K/32] -> float64 [N, K]."""
    n, half = packed.shape
    out = torch.empty(n, half * 2, dtype=torch.float64)
    p, s = packed.tolist(), scale.tolist()
    for r in range(n):
        for j in range(half):
            byte = p[r][j]
            for nib, code in ((0, byte & 0xF), (1, byte >> 4)):
                col = 2 * j + nib
                out[r, col] = decode_e2m1(code) * 2.0 ** (s[r][col // 32] - 127)
    return out


def loop_dequant_fp8(w: torch.Tensor, scale: torch.Tensor, granularity: str, block=(128, 128)):
    """One expert: fp8 [N, K] and its scale -> float64 [N, K]."""
    n, k = w.shape
    values = w.to(torch.float64)
    out = torch.empty(n, k, dtype=torch.float64)
    for r in range(n):
        for c in range(k):
            if granularity == "tensor":
                s = scale.reshape(()).item()
            elif granularity == "channel":
                s = scale[r].item()
            else:
                s = scale[r // block[0], c // block[1]].item()
            out[r, c] = values[r, c] * s
    return out


# -- the experts -----------------------------------------------------------------------------


def loop_activation(kind: str, params, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    def sig(v):
        return 1.0 / (1.0 + torch.exp(-v))

    if kind == "silu":
        return gate * sig(gate) * up
    if kind == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if kind == "situ":
        beta, beta_l = params
        return beta * torch.tanh(gate / beta) * sig(gate) * beta_l * torch.tanh(up / beta_l)
    alpha, limit = params
    g = torch.minimum(gate, torch.full_like(gate, limit))
    u = torch.maximum(torch.minimum(up, torch.full_like(up, limit)), torch.full_like(up, -limit))
    return g * sig(alpha * g) * (u + 1.0)


def loop_moe(x, w13_f, w2_f, topk_weights, topk_ids, activation, on_input=False, expert_map=None,
             b13=None, b2=None, act_quant=None):
    """Per token, per chosen expert, in float64. w13_f [E, 2I, H] and w2_f [E, H, I] are dense.

    `act_quant(v)` models what a w8a8 kernel does to each GEMM's input.
    """
    m = x.shape[0]
    inter = w13_f.shape[1] // 2
    out = torch.zeros(m, x.shape[1], dtype=torch.float64)
    for t in range(m):
        for j in range(topk_ids.shape[1]):
            gid = int(topk_ids[t, j])
            e = gid if expert_map is None else expert_map[gid]
            if e < 0:
                continue
            w = float(topk_weights[t, j])
            xin = x[t].double() * (w if on_input else 1.0)
            if act_quant:
                xin = act_quant(xin[None])[0].double()
            h = w13_f[e].double() @ xin
            if b13 is not None:
                h = h + b13[e].double()
            a = loop_activation(activation.kind, activation.params, h[:inter], h[inter:])
            if act_quant:
                a = act_quant(a[None])[0].double()
            y = w2_f[e].double() @ a
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += y if on_input else w * y
    return out
