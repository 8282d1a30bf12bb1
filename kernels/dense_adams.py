"""Dense AdamS on a flat tensor (warm-up steps, ``unmasked_update="momentum"``, the AdamS optimizer).

c     = 1 - b1**t (or 1)
theta = theta * (1 - lr * wd)
nu    = b2 * (m / c)**2 + (1 - b2) * g**2
m     = b1 * m + (1 - b1) * g
theta = theta - lr_update * (m / c) / (sqrt(nu) + eps)
"""

from __future__ import annotations

from torch import Tensor


def dense_adams_ref(
    param: Tensor,
    momentum: Tensor,
    grad: Tensor | None,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    lr_update: float | None = None,
) -> None:
    """Pure-PyTorch reference (and CPU path), in place.

    Args:
        param: Parameters (any float dtype); the arithmetic runs in ``momentum.dtype``.
        momentum: First moment m, same shape, fp32 or fp64.
        grad: Gradient, same shape; None means g = 0 (momentum-only step).
        step: The step t (1-based).
        lr: Learning rate (drives weight decay, and the update unless ``lr_update`` is given).
        beta1: b1.
        beta2: b2.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay.
        bias_correction: Divide the momenta by ``1 - b1**t``.
        lr_update: Learning rate of the update term, if different from ``lr``.
    """
    lr_u = lr if lr_update is None else lr_update
    sdt = momentum.dtype
    c = 1.0 - beta1**step if bias_correction else 1.0
    theta = param if param.dtype == sdt else param.to(sdt)
    if weight_decay != 0.0:
        theta.mul_(1.0 - lr * weight_decay)
    nu = (momentum / c).square_().mul_(beta2)
    momentum.mul_(beta1)
    if grad is not None:
        g = grad.to(sdt)
        nu.add_(g.square(), alpha=1.0 - beta2)
        momentum.add_(g, alpha=1.0 - beta1)
    theta.addcdiv_(momentum, nu.sqrt_().add_(eps), value=-lr_u / c)
    if theta is not param:
        param.copy_(theta)
