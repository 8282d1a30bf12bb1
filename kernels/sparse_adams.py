"""AdamS on the masked coordinates a rank updates, from the one averaged buffer.

For each slot (coordinate j, averaged value g, step t, c = 1 - b1**t or 1):

    tau   = t - last_sent[j]                      steps since j was last sent (>= 1)
    g2    = (g / tau)**2 if staleness else g**2   second-moment input
    nu    = b2 * (m[j] / c)**2 + (1 - b2) * g2
    m[j]  = b1 * m[j] + (1 - b1) * g
    s     = min(tau, cap) if catch_up else 1
    out   = theta[j] * (1 - lr * wd) - lr_update * s * (m[j] / c) / (sqrt(nu) + eps)
    last_sent[j] = t
"""

from __future__ import annotations

from torch import Tensor

from ._positions import mask_positions


def sparse_adams_ref(
    param: Tensor,
    momentum: Tensor,
    last_sent: Tensor,
    gbar: Tensor,
    mask: Tensor,
    chunk_size: int,
    out: Tensor,
    *,
    step: int,
    lr: float,
    lr_update: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    staleness_correction: bool,
    catch_up: bool,
    catch_up_cap: float,
) -> None:
    """Pure-PyTorch reference (and CPU path).

    Args:
        param: ``[rows * chunk_size]`` parameters of the region this rank updates (read only).
        momentum: Same length, fp32/fp64 first moment, updated at the masked slots.
        last_sent: Same length, int32 step at which each coordinate was last sent, set to ``step``.
        gbar: ``[rows * k]`` averaged values of the slots, in mask order.
        mask: ``[rows, k]`` int16 chunk-local indices of the region.
        chunk_size: Coordinates per chunk.
        out: ``[rows * k]`` new parameter values at the slots (parameter dtype).
        step: The step t being taken (1-based, warm-up included).
        lr: The group's learning rate (drives weight decay).
        lr_update: Learning rate of the AdamS update (``lr * sparse_lr_scale``).
        beta1: First-moment decay b1.
        beta2: Second-moment decay b2.
        eps: Denominator epsilon.
        weight_decay: Decoupled weight decay wd.
        bias_correction: Divide the momenta by ``1 - b1**t``.
        staleness_correction: Divide g by tau in the second-moment term.
        catch_up: Scale the update by ``min(tau, catch_up_cap)``.
        catch_up_cap: Cap of the catch-up factor.
    """
    pos = mask_positions(mask, chunk_size)
    sdt = momentum.dtype
    c = 1.0 - beta1**step if bias_correction else 1.0
    theta = param.index_select(0, pos).to(sdt)
    m_prev = momentum.index_select(0, pos)
    g = gbar.to(sdt)
    tau = (step - last_sent.index_select(0, pos)).to(sdt) if (staleness_correction or catch_up) else None
    g2 = (g / tau).square() if (staleness_correction and tau is not None) else g.square()
    nu = (m_prev / c).square_().mul_(beta2).add_(g2, alpha=1.0 - beta2)
    m = m_prev.mul(beta1).add_(g, alpha=1.0 - beta1)
    upd = (m / c).div_(nu.sqrt_().add_(eps))
    if catch_up and tau is not None:
        upd.mul_(tau.clamp(max=catch_up_cap))
    new = theta.mul_(1.0 - lr * weight_decay).sub_(upd, alpha=lr_update)
    out.copy_(new)
    momentum.index_copy_(0, pos, m)
    last_sent.index_fill_(0, pos, step)
