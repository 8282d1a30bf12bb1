"""AdamS against an independent, element-by-element fp64 implementation of docs/algorithm.md section 2."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_scape import AdamS


def spec_adams(
    theta: list[float],
    m: list[float],
    g: list[float],
    t: int,
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    bias_correction: bool,
) -> tuple[list[float], list[float]]:
    """The spec's formula with Python floats, one coordinate at a time."""
    c = 1 - b1**t if bias_correction else 1.0
    c_prev = 1 - b1 ** (t - 1) if bias_correction and t > 1 else 1.0
    # The previous momentum's weight, as Adam's bias-corrected second moment weighs its previous estimate (0 at t = 1).
    w = b2 * (1 - b2 ** (t - 1)) / (1 - b2**t) if bias_correction else b2
    new_theta, new_m = [], []
    for th, mp, gi in zip(theta, m, g, strict=True):
        th = th * (1 - lr * wd)
        nu = w * (mp / c_prev) ** 2 + (1 - w) * gi**2
        mn = b1 * mp + (1 - b1) * gi
        th = th - lr * (mn / c) / (math.sqrt(nu) + eps)
        new_theta.append(th)
        new_m.append(mn)
    return new_theta, new_m


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_the_spec_formula_over_steps(bias_correction: bool) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    opt = AdamS([p], lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, bias_correction=bias_correction)
    theta, m = p.detach().tolist(), [0.0] * 7
    for t in range(1, 6):
        g = torch.randn(7, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        theta, m = spec_adams(theta, m, g.tolist(), t, 0.01, 0.8, 0.9, 1e-6, 0.3, bias_correction)
        assert p.detach().tolist() == pytest.approx(theta, rel=1e-12, abs=1e-14)
        assert opt.state[p]["exp_avg"].tolist() == pytest.approx(m, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("b2", [0.95, 0.999])
def test_the_first_step_moves_every_coordinate_by_the_learning_rate_as_adam(b2: float) -> None:
    # Hand-worked: t=1, m_prev=0, g=(2, -0.5): nu = g^2 (no previous momentum), m = 0.1 g, c = 0.1,
    # step = lr * (m/c) / |g| = lr * sign(g), whatever b2 (with b2's weight on the zero momentum it would be
    # lr / sqrt(1 - b2): 4.47 lr at 0.95, 31.6 lr at 0.999). torch's Adam moves by lr too.
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    q = torch.nn.Parameter(p.detach().clone())
    p.grad = torch.tensor([2.0, -0.5], dtype=torch.float64)
    q.grad = p.grad.clone()
    AdamS([p], lr=0.01, betas=(0.9, b2), eps=0.0, weight_decay=0.0).step()
    torch.optim.Adam([q], lr=0.01, betas=(0.9, b2), eps=0.0).step()
    assert p.tolist() == pytest.approx([0.99, 1.01], rel=1e-12)
    assert p.tolist() == pytest.approx(q.tolist(), rel=1e-12)


def test_the_second_step_weighs_the_first_momentum_and_the_gradient_as_adam_weighs_its_two_squares() -> None:
    # Hand-worked: g1 = 1, g2 = 3, b1 = 0.9, b2 = 0.999. After step 1, m = 0.1 (and theta = -lr). Step 2:
    # c' = 0.1, so the previous momentum stands for m / c' = 1 = g1; b2_2 = b2 (1 - b2) / (1 - b2^2) = b2 / (1 + b2),
    # nu = (b2 * 1 + 1 * 9) / (1 + b2) = 9.999 / 1.999, exactly Adam's bias-corrected second moment here;
    # m = 0.09 + 0.3 = 0.39, c = 0.19. (With b2's weight, nu = 0.999 + 0.009: a step 1.58x as long.)
    b2 = 0.999
    p = torch.nn.Parameter(torch.tensor([0.0], dtype=torch.float64))
    q = torch.nn.Parameter(torch.tensor([0.0], dtype=torch.float64))
    opt = AdamS([p], lr=0.01, betas=(0.9, b2), eps=0.0, weight_decay=0.0)
    adam = torch.optim.Adam([q], lr=0.01, betas=(0.9, b2), eps=0.0)
    for g in (1.0, 3.0):
        p.grad = torch.tensor([g], dtype=torch.float64)
        q.grad = p.grad.clone()
        opt.step()
        adam.step()
    second = 0.01 * (0.39 / 0.19) / math.sqrt((b2 + 9) / (1 + b2))
    assert p.item() == pytest.approx(-0.01 - second, rel=1e-12)
    assert p.item() == pytest.approx(q.item(), rel=1e-12)


def test_without_bias_correction_the_first_step_is_the_papers_text() -> None:
    # nu = b2 * 0 + (1 - b2) g^2, m = (1 - b1) g: the step is lr (1 - b1) / sqrt(1 - b2) = 0.4472 lr at (0.9, 0.95).
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    p.grad = torch.tensor([2.0], dtype=torch.float64)
    AdamS([p], lr=0.01, eps=0.0, weight_decay=0.0, bias_correction=False).step()
    assert p.item() == pytest.approx(1.0 - 0.01 * 0.1 / math.sqrt(0.05), rel=1e-12)


def test_param_groups_use_their_own_hyperparameters_and_skip_params_without_grad() -> None:
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(3))
    unused = torch.nn.Parameter(torch.ones(3))
    opt = AdamS([{"params": [a]}, {"params": [b, unused], "lr": 0.1, "weight_decay": 0.0}], lr=0.01)
    a.grad = torch.ones(3)
    b.grad = torch.ones(3)
    opt.step()
    # First step with g=1: c = 0.1, m = 0.1, nu = g^2 = 1, step = lr * (0.1 / 0.1) / 1 = lr.
    unit = 1.0
    assert a.detach() == pytest.approx(torch.full((3,), 1 * (1 - 0.01 * 0.1) - 0.01 * unit), rel=1e-5)
    assert b.detach() == pytest.approx(torch.full((3,), 1 - 0.1 * unit), rel=1e-5)
    assert torch.equal(unused.detach(), torch.ones(3)) and unused not in opt.state


def test_closure_is_evaluated_with_grad_enabled_and_returned() -> None:
    p = torch.nn.Parameter(torch.tensor([3.0]))
    opt = AdamS([p], lr=0.1)

    def closure() -> float:
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == pytest.approx(9.0)
    assert p.item() < 3.0


def test_state_dict_round_trip_continues_identically() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    twin = torch.nn.Linear(5, 3)
    twin.load_state_dict(model.state_dict())
    opt = AdamS(model.parameters(), lr=0.05)
    data = [torch.randn(4, 5) for _ in range(6)]
    for x in data[:3]:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    twin.load_state_dict(model.state_dict())
    twin_opt = AdamS(twin.parameters(), lr=0.05)
    # Through serialization, as a checkpoint would (load_state_dict keeps same-dtype tensors by reference).
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    twin_opt.load_state_dict(torch.load(buf))
    for x in data[3:]:
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bf16_parameters_keep_fp32_momentum() -> None:
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    opt = AdamS([p], lr=0.01)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and (p < 1).all()


def test_invalid_hyperparameters_raise() -> None:
    p = [torch.nn.Parameter(torch.ones(1))]
    with pytest.raises(ValueError, match="betas"):
        AdamS(p, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr"):
        AdamS(p, lr=-1.0)
