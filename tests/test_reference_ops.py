"""The pure-PyTorch reference ops against hand-worked cases (the Triton kernels are tested against these)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_scape.kernels import (
    AdamSHyper,
    chunk_topk_ref,
    dense_adams_ref,
    ef_compact_ref,
    mask_positions,
    mask_scores_ref,
    scatter_decay_ref,
    sparse_adams_ref,
)


def test_mask_positions_address_chunks_in_row_major_order() -> None:
    mask = torch.tensor([[0, 3], [1, 2]], dtype=torch.int16)
    assert mask_positions(mask, 4).tolist() == [0, 3, 5, 6]


def test_ef_compact_sends_the_masked_sum_and_keeps_the_rest() -> None:
    e = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    g = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0])
    mask = torch.tensor([[1], [3]], dtype=torch.int16)  # chunk 0 slot 1, chunk 1 slot 3 -> positions 1, 7
    out = torch.empty(2)
    ef_compact_ref(e, g, mask, 4, out)
    assert out.tolist() == [22.0, 88.0]
    assert e.tolist() == [11.0, 0.0, 33.0, 44.0, 55.0, 66.0, 77.0, 0.0]


def test_ef_compact_keeps_the_cast_error_of_a_bf16_buffer_in_the_residual() -> None:
    e = torch.zeros(4, dtype=torch.float32)
    g = torch.tensor([1.0 + 2**-10, 0.0, 0.0, 0.0])  # not representable in bf16 (8 mantissa bits)
    out = torch.empty(1, dtype=torch.bfloat16)
    ef_compact_ref(e, g, torch.tensor([[0]], dtype=torch.int16), 4, out)
    assert out.item() == 1.0
    assert e[0].item() == 2**-10  # nothing lost: sent + residual == gradient
    assert out.float().item() + e[0].item() == g[0].item()


def test_chunk_topk_picks_largest_with_ties_to_lower_index_and_sorted_rows() -> None:
    s = torch.tensor([0.5, 2.0, 2.0, 1.0, 2.0, 0.0, 3.0, 3.0])
    idx = chunk_topk_ref(s, 8, k=3, k_explore=0, explore_offset=0)
    assert idx.dtype == torch.int16
    assert idx.tolist() == [[1, 6, 7]]  # 3, 3, then the first of the three 2.0s (index 1)
    idx = chunk_topk_ref(s, 8, k=4, k_explore=0, explore_offset=0)
    assert idx.tolist() == [[1, 2, 6, 7]]


def test_chunk_topk_forces_the_exploration_window_with_wrap_around() -> None:
    s = torch.arange(8.0)  # largest at the end
    idx = chunk_topk_ref(s, 8, k=3, k_explore=2, explore_offset=7)  # window {7, 0}
    assert idx.tolist() == [[0, 6, 7]]  # window 7, 0 + best outside it: 6
    idx = chunk_topk_ref(s, 8, k=3, k_explore=2, explore_offset=2)  # window {2, 3}
    assert idx.tolist() == [[2, 3, 7]]


def test_chunk_topk_matches_torch_topk_sets_on_tie_free_data() -> None:
    torch.manual_seed(0)
    s = torch.randn(5 * 64)
    idx = chunk_topk_ref(s, 64, k=7, k_explore=0, explore_offset=0)
    ref = torch.topk(s.view(5, 64), 7, dim=1).indices.sort(dim=1).values
    assert torch.equal(idx.long(), ref)


def test_chunk_topk_treats_nan_as_lowest_and_inf_as_a_real_score() -> None:
    s = torch.tensor([float("nan"), float("inf"), 1.0, 2.0])
    assert chunk_topk_ref(s, 4, k=2, k_explore=0, explore_offset=0).tolist() == [[1, 3]]


def test_mask_scores() -> None:
    m = torch.tensor([1.0, -2.0])
    e = torch.tensor([-10.0, 10.0])
    assert mask_scores_ref(m, e, 0.9, "momentum").tolist() == pytest.approx([0.1, 0.8])
    assert mask_scores_ref(m, e, 0.9, "gradient").tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="no score function"):
        mask_scores_ref(m, e, 0.9, "random")


def test_scatter_decay_decays_everything_then_writes_the_mask() -> None:
    p = torch.ones(8)
    scatter_decay_ref(p, torch.tensor([5.0, 6.0]), torch.tensor([[0], [2]], dtype=torch.int16), 4, 0.5)
    assert p.tolist() == [5.0, 0.5, 0.5, 0.5, 0.5, 0.5, 6.0, 0.5]


def test_a_coordinate_sent_again_at_once_takes_one_adams_step_and_only_the_slots_move() -> None:
    """tau = 1 (last sent at the previous step): the spec's AdamS formula, by hand."""
    b1, b2, eps, lr, wd, t = 0.9, 0.95, 1e-8, 0.1, 0.1, 10
    param = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    m = torch.tensor([0.5, -0.5, 0.25, 0.0], dtype=torch.float64)
    last = torch.tensor([4, 9, 4, 4], dtype=torch.int32)  # coordinate 1 was last sent at step 9
    out = torch.empty(1, dtype=torch.float64)
    hyper = AdamSHyper(step=t, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, catch_up_cap=4.0)
    sparse_adams_ref(param, m, last, torch.tensor([6.0], dtype=torch.float64), torch.tensor([[1]], dtype=torch.int16),
                     4, out, hyper)  # fmt: skip
    c, c_prev, b2_t = 1 - b1**t, 1 - b1 ** (t - 1), b2 * (1 - b2 ** (t - 1)) / (1 - b2**t)
    nu = b2_t * (-0.5 / c_prev) ** 2 + (1 - b2_t) * 6.0**2
    m_new = b1 * -0.5 + (1 - b1) * 6.0
    assert out.item() == pytest.approx(2.0 * (1 - lr * wd) - lr * (m_new / c) / (math.sqrt(nu) + eps), rel=1e-12)
    assert m.tolist() == pytest.approx([0.5, m_new, 0.25, 0.0], rel=1e-12)
    assert last.tolist() == [4, 10, 4, 4]
    assert param.tolist() == [1.0, 2.0, 3.0, 4.0]  # read only


def test_dense_adams_with_no_gradient_moves_along_the_momentum() -> None:
    p = torch.tensor([1.0], dtype=torch.float64)
    m = torch.tensor([0.2], dtype=torch.float64)
    hyper = AdamSHyper(step=100, lr=0.1, beta1=0.9, beta2=0.95, eps=0.0, weight_decay=0.0, bias_correction=False)
    dense_adams_ref(p, m, None, hyper)
    # nu = 0.95 * 0.04, m = 0.18, step = 0.1 * 0.18 / sqrt(0.038)
    assert m.item() == pytest.approx(0.18)
    assert p.item() == pytest.approx(1.0 - 0.1 * 0.18 / math.sqrt(0.95 * 0.04))


def test_the_interval_update_integrates_adams_over_the_interval_by_hand() -> None:
    """Coordinate 1 was last sent at step 94 and is sent at step 100 with accumulated 6.0: tau = 6."""
    b1, b2, eps, lr, wd, t, tau = 0.9, 0.95, 1e-8, 0.1, 0.1, 100, 6
    m_prev, g, theta = 0.5, 6.0, 2.0
    c, c_prev, b2_t = 1 - b1**t, 1 - b1 ** (t - 1), b2 * (1 - b2 ** (t - 1)) / (1 - b2**t)
    mean = g / tau
    v = max(g**2 / tau - (tau - 1) * (m_prev / c_prev) ** 2, mean**2)
    nu = b2_t * (m_prev / c_prev) ** 2 + (1 - b2_t) * v
    carried = b1 * (1 - b1**tau) / (1 - b1)  # sum of b1**s for s = 1..tau
    disp = (m_prev * carried + mean * (tau - carried)) / c / (math.sqrt(nu) + eps)
    bound = ((b1 * c_prev / c) ** 2 / b2_t + (1 - b1) ** 2 / (c**2 * (1 - b2_t))) ** 0.5
    for cap, moved in ((1000.0, disp), (2.0, 2 * bound)):
        param = torch.tensor([1.0, theta, 3.0, 4.0], dtype=torch.float64)
        m = torch.tensor([0.5, m_prev, 0.25, 0.0], dtype=torch.float64)
        last = torch.tensor([99, 94, 99, 99], dtype=torch.int32)
        out = torch.empty(1, dtype=torch.float64)
        hyper = AdamSHyper(step=t, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, catch_up_cap=cap)
        sparse_adams_ref(param, m, last, torch.tensor([g], dtype=torch.float64), torch.tensor([[1]], dtype=torch.int16),
                         4, out, hyper)  # fmt: skip
        assert out.item() == pytest.approx(theta * (1 - lr * wd) - lr * moved, rel=1e-12)
        assert m[1].item() == pytest.approx(b1**tau * m_prev + (1 - b1**tau) * mean, rel=1e-12)
        assert last.tolist() == [99, 100, 99, 99]
    assert 2 * bound < disp < tau * bound  # the bound of tau steps is not reached, the cap of 2 steps is


@pytest.mark.parametrize("b2", [0.95, 0.999])
def test_an_interval_moves_no_farther_than_dense_adams_over_it(b2: float) -> None:
    """A coordinate with no momentum yet (a gradient that appears after a long quiet spell) receives the same
    gradient every step of a tau-step interval. Dense AdamS's first step moves it by (1 - b1) / sqrt(1 - b2) lr
    (3.16 lr at b2 = 0.999), and the momentum it builds brings the next steps back to about lr; the interval update
    must not move it farther than those tau dense steps summed (with b2 = 0.999 its bound once allowed 3.2x)."""
    b1, lr, t, tau, g = 0.9, 1e-3, 1000, 8, 0.5
    dense_p = torch.zeros(1, dtype=torch.float64)
    dense_m = torch.zeros(1, dtype=torch.float64)
    for s in range(t - tau + 1, t + 1):
        hyper = AdamSHyper(step=s, lr=lr, beta1=b1, beta2=b2, eps=0.0, weight_decay=0.0)
        dense_adams_ref(dense_p, dense_m, torch.tensor([g], dtype=torch.float64), hyper)
    dense_moved = -dense_p.item() / lr
    param = torch.zeros(2, dtype=torch.float64)
    m = torch.zeros(2, dtype=torch.float64)
    last = torch.tensor([t - 1, t - tau], dtype=torch.int32)
    out = torch.empty(1, dtype=torch.float64)
    hyper = AdamSHyper(step=t, lr=lr, beta1=b1, beta2=b2, eps=0.0, weight_decay=0.0, catch_up_cap=32.0)
    sent = torch.tensor([g * tau], dtype=torch.float64)  # the interval's accumulated gradient, coordinate 1
    sparse_adams_ref(param, m, last, sent, torch.tensor([[1]], dtype=torch.int16), 2, out, hyper)
    moved = -out.item() / lr
    assert 0.5 * dense_moved < moved <= dense_moved
