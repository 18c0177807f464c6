import pytest
import torch

from moe_overlay.errors import MoEInputError
from moe_overlay.routing import grouped_topk, sigmoid_top1, softmax_topk
from tests.loops import loop_grouped_topk, loop_sigmoid_top1, loop_softmax_topk


def _check(weights, ids, ref_w, ref_ids):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), ref_ids.long())
    torch.testing.assert_close(weights.double(), ref_w.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,k", [(8, 2), (7, 3), (5, 5), (12, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_loop(experts, k, renormalize):
    logits = torch.randn(33, experts, generator=torch.Generator().manual_seed(experts * 10 + k))
    _check(*softmax_topk(logits, k, renormalize), *loop_softmax_topk(logits, k, renormalize))


def test_softmax_topk_ties_go_to_lower_id():
    logits = torch.zeros(4, 6)
    logits[:, 3] = 1.0
    weights, ids = softmax_topk(logits, 3)
    _check(weights, ids, *loop_softmax_topk(logits, 3, True))
    assert ids[0].tolist() == [3, 0, 1]


@pytest.mark.parametrize(
    "experts,k,groups,keep",
    [(16, 4, 4, 2), (12, 3, 1, 1), (24, 8, 8, 4), (6, 6, 1, 1), (10, 2, 5, 3), (9, 3, 3, 1)],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_topk_matches_loop(experts, k, groups, keep, with_bias):
    gen = torch.Generator().manual_seed(experts + k + groups)
    logits = torch.randn(29, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.5 if with_bias else None
    got = grouped_topk(logits, k, groups, keep, "sigmoid", bias, True, 2.5)
    _check(*got, *loop_grouped_topk(logits, k, groups, keep, bias, True, 2.5))


def test_grouped_topk_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = grouped_topk(logits, 1, correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[0.0]])))


def test_grouped_topk_ties():
    logits = torch.zeros(3, 8)
    weights, ids = grouped_topk(logits, 2, 4, 2, renormalize=False)
    _check(weights, ids, *loop_grouped_topk(logits, 2, 4, 2, None, False, 1.0))
    assert ids[0].tolist() == [0, 1]


@pytest.mark.parametrize("experts,k", [(16, 1), (5, 1), (6, 2)])
def test_sigmoid_top1_matches_loop(experts, k):
    logits = torch.randn(17, experts, generator=torch.Generator().manual_seed(experts))
    _check(*sigmoid_top1(logits, k), *loop_sigmoid_top1(logits, k))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: softmax_topk(torch.randn(3, 4), 5), "top_k=5"),
        (lambda: softmax_topk(torch.randn(3), 1), "router logits"),
        (lambda: grouped_topk(torch.randn(3, 10), 2, num_groups=3), "num_groups=3"),
        (lambda: grouped_topk(torch.randn(3, 8), 2, 4, 5), "topk_groups=5"),
        (lambda: grouped_topk(torch.randn(3, 8), 5, 4, 2), "top_k=5"),
        (lambda: grouped_topk(torch.randn(3, 8), 2, correction_bias=torch.zeros(7)), "correction bias"),
        (lambda: softmax_topk(torch.zeros(3, 4, dtype=torch.int64), 1), "floating point"),
    ],
)
def test_routing_bad_input(call, message):
    with pytest.raises(MoEInputError, match=message):
        call()


def test_routing_empty_batch():
    weights, ids = grouped_topk(torch.randn(0, 8), 2, 2, 1)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)
