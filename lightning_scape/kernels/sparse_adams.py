"""AdamS on the masked coordinates a rank updates, from the one averaged buffer: the interval update.

A coordinate sent at step t was last sent tau = t - last_sent[j] >= 1 steps ago, and g is the average over
ranks of its accumulated gradient. The update moves it as dense AdamS would have over those tau steps had
the gradient arrived evenly (mean gm = g / tau per step). With dense AdamS's c, c' and b2_t (``dense_adams.py``)
and m = m[j]:

    v     = max(g**2 / tau - (tau - 1) (m / c')**2, gm**2)     per-step second moment of the interval
    nu    = b2_t (m / c')**2 + (1 - b2_t) v
    a     = b1**tau,  A = b1 (1 - a) / (1 - b1)                 A: steps of movement left in the old m
    m[j]  = a m + (1 - a) gm
    d     = (A m + (tau - A) gm) / c / (sqrt(nu) + eps)         dense AdamS's steps, summed over the interval
    d     = clamp(d, +-min(tau, cap) B)                         B: the most one AdamS step moves (see below)
    out   = theta[j] (1 - lr wd) - lr d
    last_sent[j] = t

At tau = 1 this is one AdamS step, computed as AdamS computes it (bit for bit).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._hyper import AdamSHyper
from ._positions import mask_positions
from ._signature import signature_of
from ._triton import HAS_TRITON, LOW_FLOATS, cast_rne, require_triton, tl, triton, use_triton


def sparse_adams_ref(
    param: Tensor,
    momentum: Tensor,
    last_sent: Tensor,
    gbar: Tensor,
    mask: Tensor,
    chunk_size: int,
    out: Tensor,
    hyper: AdamSHyper,
) -> None:
    """Pure-PyTorch reference (and CPU path).

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        param: ``[rows * chunk_size]`` parameters of the region this rank updates (read only).
        momentum: Same length, fp32/fp64 first moment, updated at the masked slots.
        last_sent: Same length, int32 step at which each coordinate was last sent, set to ``step``.
        gbar: ``[rows * k]`` averaged values of the slots, in mask order.
        mask: ``[rows, k]`` int16 chunk-local indices of the region.
        chunk_size: Coordinates per chunk.
        out: ``[rows * k]`` new parameter values at the slots (parameter dtype).
        hyper: The step's hyperparameters (``catch_up_cap``: the most steps of movement at once).
    """
    h = hyper
    pos = mask_positions(mask, chunk_size)
    sdt = momentum.dtype
    theta = param.index_select(0, pos).to(sdt)
    m_prev = momentum.index_select(0, pos)
    g = gbar.to(sdt)
    tau = (h.step - last_sent.index_select(0, pos)).to(sdt)
    m, disp = _interval_update(m_prev, g, tau, h)
    # A coordinate sent again at once (tau = 1) takes AdamS's own step, computed as AdamS computes it.
    again = tau == 1
    if bool(again.any()):
        m_one, disp_one = _adams_step(m_prev, g, h)
        m, disp = torch.where(again, m_one, m), torch.where(again, disp_one, disp)
    out.copy_(theta.mul_(h.decay).sub_(disp, alpha=h.lr))
    momentum.index_copy_(0, pos, m)
    last_sent.index_fill_(0, pos, h.step)


@signature_of(sparse_adams_ref)
def sparse_adams(
    param: Tensor,
    momentum: Tensor,
    last_sent: Tensor,
    gbar: Tensor,
    mask: Tensor,
    chunk_size: int,
    out: Tensor,
    hyper: AdamSHyper,
) -> None:
    """AdamS on the masked slots: the entry point (see :func:`sparse_adams_ref` for the arguments).

    Runs :func:`sparse_adams_triton` where :func:`~._triton.use_triton` allows it and the kernel takes the
    dtypes, :func:`sparse_adams_ref` otherwise; fp64 state runs the ref.
    """
    fn = sparse_adams_ref
    if (
        use_triton(param, momentum, last_sent, gbar, mask, out)
        and momentum.dtype == torch.float32
        and last_sent.dtype == torch.int32
        and param.dtype in LOW_FLOATS
        and gbar.dtype in LOW_FLOATS
        and out.dtype in LOW_FLOATS
    ):
        fn = sparse_adams_triton
    fn(param, momentum, last_sent, gbar, mask, chunk_size, out, hyper)


# The largest b2 the interval bound is computed with. B's second term, the whole gradient against a momentum near
# zero, grows as 1 / sqrt(1 - b2) (3.29 at b2 = 0.999), but dense AdamS takes such a step once: it builds the
# momentum that bounds the next ones, so over an interval its steps average about lr. With b2 above this, a
# coordinate whose momentum was small could move 3.2x as far as dense AdamS in one interval update
# (docs/algorithm.md section 4).
INTERVAL_BOUND_MAX_BETA2 = 0.95


def interval_bound_per_step(h: AdamSHyper) -> float:
    """B: the most dense AdamS moves a coordinate in one step, in units of the learning rate, with b2 at most
    :data:`INTERVAL_BOUND_MAX_BETA2`.

    Its update is ``(a m / c' + e g) / sqrt(b2_t (m / c')^2 + (1 - b2_t) g^2)`` with ``a = b1 c' / c`` and
    ``e = (1 - b1) / c``; Cauchy-Schwarz gives ``B = sqrt(a^2 / b2_t + e^2 / (1 - b2_t))``: 1.026 with the betas
    (0.9, 0.95) once the bias corrections are done, and 1 at the first step (no momentum yet, ``nu = g^2``). The
    interval update moves by at most ``min(tau, cap) B``: a coordinate frozen for tau steps keeps seeing the
    gradient of where it stopped, so a long interval would overshoot where dense AdamS, re-reading the
    gradient every step, stops.
    """
    c, b1, b2 = h.bias_c, h.beta1, h.nu_beta2
    e = (1.0 - b1) / c
    if h.age <= 1 or b1 == 0.0:  # no previous momentum to move along
        return abs(e) / (1.0 - b2) ** 0.5
    b2 = min(b2, INTERVAL_BOUND_MAX_BETA2)
    if b2 == 0.0:  # nu = g^2: a gradient near zero leaves the momentum's step unbounded
        return math.inf
    a = b1 * h.prev_c / c
    return (a * a / b2 + e * e / (1.0 - b2)) ** 0.5


def _adams_step(m_prev: Tensor, g: Tensor, h: AdamSHyper) -> tuple[Tensor, Tensor]:
    """One AdamS step from ``g``: the new momentum and the update in units of the learning rate."""
    c, b2 = h.bias_c, h.nu_beta2
    nu = (m_prev / h.prev_c).square_().mul_(b2).add_(g.square(), alpha=1.0 - b2)
    m = m_prev.mul(h.beta1).add_(g, alpha=1.0 - h.beta1)
    return m, (m / c).div_(nu.sqrt_().add_(h.eps))


def _interval_update(m_prev: Tensor, g: Tensor, tau: Tensor, h: AdamSHyper) -> tuple[Tensor, Tensor]:
    """The new momentum and the displacement (in units of the learning rate) of the interval update."""
    c, b1, b2 = h.bias_c, h.beta1, h.nu_beta2
    gm = g / tau  # the mean gradient of the interval
    mp = m_prev / h.prev_c
    # Per-step second moment: E[g^2] = mean^2 + noise; the accumulated g alone over-states it by
    # (tau - 1) mean^2 for a steady coordinate, which the momentum (the mean before the interval) removes.
    v = torch.maximum(g.square().div_(tau).sub_(mp.square().mul_(tau - 1)), gm.square())
    nu = mp.square().mul_(b2).add_(v, alpha=1.0 - b2)
    decay = torch.exp2(tau * (math.log2(b1) if b1 > 0 else -math.inf))  # b1 ** tau, as the kernel computes it
    carried = decay.neg().add_(1.0).mul_(b1 / (1.0 - b1))  # steps of movement left in the old momentum
    m = m_prev * decay + gm * decay.neg().add_(1.0)
    disp = (m_prev * carried + gm * (tau - carried)).div_(c).div_(nu.sqrt_().add_(h.eps))
    bound = tau.clamp(max=h.catch_up_cap).mul_(interval_bound_per_step(h))
    return m, torch.minimum(torch.maximum(disp, -bound), bound)


if HAS_TRITON:
    # Not specialized (docs/kernels.md, "Compile time"): the step (it changes every step), and what the density
    # ramp changes, k, the slot count and the address of the region's mask rows (which moves with k). They only
    # address the slots: k divides, the slot count bounds the contiguous accesses (2 + 2 b_p bytes a slot, loaded
    # unvectorized, still coalesced), and the state is gathered anyway.
    @triton.jit(do_not_specialize=["mask_ptr", "n_slots", "k", "step"])
    def _sparse_adams_kernel(
        param_ptr: tl.tensor,
        mom_ptr: tl.tensor,
        last_ptr: tl.tensor,
        gbar_ptr: tl.tensor,
        mask_ptr: tl.tensor,
        out_ptr: tl.tensor,
        n_slots: tl.tensor,
        k: tl.tensor,
        step: tl.tensor,
        c: tl.tensor,
        c_prev: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        beta2: tl.tensor,
        one_minus_b2: tl.tensor,
        eps: tl.tensor,
        decay: tl.tensor,
        neg_lr: tl.tensor,
        cap: tl.tensor,
        log2_b1: tl.tensor,
        b1_over_one_minus_b1: tl.tensor,
        bound_per_step: tl.tensor,
        C: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        # One lane per slot; slot s is column s % k of chunk row s // k.
        s = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = s < n_slots
        idx = tl.load(mask_ptr + s, mask=live, other=0).to(tl.int64)
        pos = (s // k) * C + idx
        theta = tl.load(param_ptr + pos, mask=live, other=0.0).to(tl.float32)
        m_prev = tl.load(mom_ptr + pos, mask=live, other=0.0)
        g = tl.load(gbar_ptr + s, mask=live, other=0.0).to(tl.float32)
        last = tl.load(last_ptr + pos, mask=live, other=0)
        tau = (step - last).to(tl.float32)
        # AdamS's step (tau = 1): the ref's operations in its order, with its fused multiply-adds (its
        # add_(x, alpha=a) is one fma on CPU and CUDA); IEEE division and sqrt like PyTorch's.
        mc = tl.div_rn(m_prev, c_prev)
        nu = tl.fma(g * g, one_minus_b2, mc * mc * beta2)
        m_one = tl.fma(g, one_minus_b1, m_prev * beta1)
        d_one = tl.div_rn(tl.div_rn(m_one, c), tl.sqrt_rn(nu) + eps)
        # The interval update (_interval_update); b1**tau as exp2, which may differ from the ref's in the last bit.
        gm = tl.div_rn(g, tau)
        v = tl.maximum(tl.div_rn(g * g, tau) - (tau - 1.0) * (mc * mc), gm * gm)
        nu_i = tl.fma(v, one_minus_b2, mc * mc * beta2)
        a = tl.exp2(tau * log2_b1)
        carried = (1.0 - a) * b1_over_one_minus_b1
        m_i = m_prev * a + gm * (1.0 - a)
        disp = tl.div_rn(tl.div_rn(m_prev * carried + gm * (tau - carried), c), tl.sqrt_rn(nu_i) + eps)
        bound = tl.minimum(tau, cap) * bound_per_step
        disp = tl.minimum(tl.maximum(disp, -bound), bound)
        m = tl.where(tau == 1.0, m_one, m_i)
        d = tl.where(tau == 1.0, d_one, disp)
        new = tl.fma(d, neg_lr, theta * decay)
        tl.store(out_ptr + s, cast_rne(new, out_ptr.dtype.element_ty), mask=live)
        tl.store(mom_ptr + pos, m, mask=live)
        tl.store(last_ptr + pos, tl.full([BLOCK], 0, tl.int32) + step, mask=live)


@signature_of(sparse_adams_ref)
def sparse_adams_triton(
    param: Tensor,
    momentum: Tensor,
    last_sent: Tensor,
    gbar: Tensor,
    mask: Tensor,
    chunk_size: int,
    out: Tensor,
    hyper: AdamSHyper,
) -> None:
    """Triton kernel of :func:`sparse_adams_ref` (same arguments; fp32 momentum only).

    One lane per slot gathers theta, m and last_sent at its coordinate, takes the interval update and
    scatters m and last_sent back: ``rows * k`` lanes, nothing dense. The operations, their order and
    their fused multiply-adds are the ref's; the results differ from it only in the last bits, because the
    kernel's ``sqrt_rn`` is correctly rounded and PyTorch's CPU ``sqrt`` is not (and ``exp2`` may differ).

    Args:
        param: ``[rows * chunk_size]`` contiguous parameters (read only).
        momentum: Same length, contiguous fp32, updated at the slots.
        last_sent: Same length, contiguous int32, set to ``step`` at the slots.
        gbar: ``[rows * k]`` contiguous averaged values, in mask order.
        mask: ``[rows, k]`` contiguous int16 chunk-local indices (distinct within a row).
        chunk_size: Coordinates per chunk.
        out: ``[rows * k]`` contiguous new parameter values at the slots.
        hyper: The step's hyperparameters.
    """
    require_triton()
    if mask.dim() != 2 or mask.dtype != torch.int16:
        raise ValueError(f"mask must be [rows, k] int16, got {tuple(mask.shape)} {mask.dtype}")
    if momentum.dtype != torch.float32 or last_sent.dtype != torch.int32:
        raise ValueError(f"momentum must be fp32 and last_sent int32, got {momentum.dtype}, {last_sent.dtype}")
    rows, k = mask.shape
    n = rows * chunk_size
    if param.numel() != n or momentum.numel() != n or last_sent.numel() != n:
        raise ValueError(f"param, momentum and last_sent must hold rows * chunk_size = {rows} * {chunk_size}")
    if gbar.numel() != rows * k or out.numel() != rows * k:
        raise ValueError(f"gbar and out must hold rows * k = {rows} * {k} values")
    n_slots = rows * k
    if n_slots == 0:
        return
    # The scalars are computed in Python (fp64) and rounded to fp32 once, exactly as the ref's scalar
    # arguments are when they meet fp32 tensors.
    h = hyper
    block = 1024
    _sparse_adams_kernel[(triton.cdiv(n_slots, block),)](
        param,
        momentum,
        last_sent,
        gbar,
        mask,
        out,
        n_slots,
        k,
        int(h.step),
        float(h.bias_c),
        float(h.prev_c),
        float(h.beta1),
        1.0 - h.beta1,
        float(h.nu_beta2),
        1.0 - h.nu_beta2,
        float(h.eps),
        h.decay,
        -float(h.lr),
        float(h.catch_up_cap),
        math.log2(h.beta1) if h.beta1 > 0 else -math.inf,
        h.beta1 / (1.0 - h.beta1),
        interval_bound_per_step(h),
        C=chunk_size,
        BLOCK=block,
        num_warps=4,
        # No fp contraction: every op rounds on its own as in the ref (its fmas are explicit tl.fma).
        enable_fp_fusion=False,
    )
