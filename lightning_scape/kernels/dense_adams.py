"""Dense AdamS on a flat tensor (the dense warm-up, and the AdamS optimizer).

c     = 1 - b1**t,  c' = 1 - b1**(t-1),  b2_t = b2 (1 - b2**(t-1)) / (1 - b2**t)   (1, 1, b2 without bias correction)
theta = theta * (1 - lr * wd)
nu    = b2_t * (m / c')**2 + (1 - b2_t) * g**2      (b2_1 = 0: g**2 alone at the first step)
m     = b1 * m + (1 - b1) * g
theta = theta - lr * (m / c) / (sqrt(nu) + eps)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._hyper import AdamSHyper
from ._signature import signature_of
from ._triton import HAS_TRITON, LOW_FLOATS, cast_rne, require_triton, tl, triton, use_triton


def dense_adams_ref(
    param: Tensor,
    momentum: Tensor,
    grad: Tensor | None,
    hyper: AdamSHyper,
) -> None:
    """Pure-PyTorch reference (and CPU path), in place.

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        param: Parameters (any float dtype); the arithmetic runs in ``momentum.dtype``.
        momentum: First moment m, same shape, fp32 or fp64.
        grad: Gradient, same shape; None means g = 0 (momentum-only step).
        hyper: The step's hyperparameters (the sparse-only fields are ignored).
    """
    h = hyper
    sdt = momentum.dtype
    c, b2 = h.bias_c, h.nu_beta2
    theta = param if param.dtype == sdt else param.to(sdt)
    if h.weight_decay != 0.0:
        theta.mul_(h.decay)
    nu = (momentum / h.prev_c).square_().mul_(b2)
    momentum.mul_(h.beta1)
    if grad is not None:
        g = grad.to(sdt)
        nu.add_(g.square(), alpha=1.0 - b2)
        momentum.add_(g, alpha=1.0 - h.beta1)
    theta.addcdiv_(momentum, nu.sqrt_().add_(h.eps), value=-h.lr / c)
    if theta is not param:
        param.copy_(theta)


@signature_of(dense_adams_ref)
def dense_adams(param: Tensor, momentum: Tensor, grad: Tensor | None, hyper: AdamSHyper) -> None:
    """Dense AdamS, in place: the entry point (see :func:`dense_adams_ref` for the arguments).

    Runs :func:`dense_adams_triton` where :func:`~._triton.use_triton` allows it and the kernel takes the
    dtypes, :func:`dense_adams_ref` otherwise; fp64 state runs the ref.
    """
    tensors = (param, momentum) if grad is None else (param, momentum, grad)
    fn = dense_adams_ref
    if (
        use_triton(*tensors)
        and momentum.dtype == torch.float32
        and param.dtype in LOW_FLOATS
        and (grad is None or grad.is_floating_point())
        and momentum.numel() == param.numel()
    ):
        fn = dense_adams_triton
    fn(param, momentum, grad, hyper)


if HAS_TRITON:

    @triton.jit
    def _dense_adams_kernel(
        param_ptr: tl.tensor,
        mom_ptr: tl.tensor,
        grad_ptr: tl.tensor,
        n: tl.tensor,
        c_prev: tl.tensor,
        beta1: tl.tensor,
        one_minus_b1: tl.tensor,
        beta2: tl.tensor,
        one_minus_b2: tl.tensor,
        eps: tl.tensor,
        decay: tl.tensor,
        neg_step: tl.tensor,
        BLOCK: tl.constexpr,
        HAS_GRAD: tl.constexpr,
    ) -> None:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = offs < n
        theta = tl.load(param_ptr + offs, mask=live, other=0.0).to(tl.float32) * decay
        m_prev = tl.load(mom_ptr + offs, mask=live, other=0.0)
        # Same order and fused multiply-adds as the ref (add_(x, alpha=a) is one fma in PyTorch); IEEE
        # division and sqrt (PyTorch's CPU sqrt is not correctly rounded: last-bit differences remain).
        mc = tl.div_rn(m_prev, c_prev)
        nu = mc * mc * beta2
        m = m_prev * beta1
        if HAS_GRAD:
            g = tl.load(grad_ptr + offs, mask=live, other=0.0).to(tl.float32)
            nu = tl.fma(g * g, one_minus_b2, nu)
            m = tl.fma(g, one_minus_b1, m)
        # addcdiv_(m, d, value=v) is theta + (v * m) / d in PyTorch's CPU kernel.
        new = theta + tl.div_rn(m * neg_step, tl.sqrt_rn(nu) + eps)
        tl.store(param_ptr + offs, cast_rne(new, param_ptr.dtype.element_ty), mask=live)
        tl.store(mom_ptr + offs, m, mask=live)


@signature_of(dense_adams_ref)
def dense_adams_triton(
    param: Tensor,
    momentum: Tensor,
    grad: Tensor | None,
    hyper: AdamSHyper,
) -> None:
    """Triton kernel of :func:`dense_adams_ref`: one fused pass (fp32 momentum only).

    Reads theta, m (and g), writes theta and m: ``(2 b_p + b_g + 8)`` bytes per element. Equal to the
    ref up to the last bits of fp32 arithmetic.

    Args:
        param: Contiguous parameters (fp32, bf16 or fp16), updated in place.
        momentum: Contiguous fp32 first moment, same number of elements.
        grad: Contiguous gradient, same number of elements; None means g = 0 (nothing is read).
        hyper: The step's hyperparameters (the sparse-only fields are ignored).
    """
    require_triton()
    if momentum.dtype != torch.float32:
        raise ValueError(f"dense_adams_triton keeps fp32 momentum, got {momentum.dtype}")
    n = param.numel()
    if momentum.numel() != n or (grad is not None and grad.numel() != n):
        raise ValueError("param, momentum and grad must have the same number of elements")
    if n == 0:
        return
    h = hyper
    c = h.bias_c
    block = 1024
    _dense_adams_kernel[(triton.cdiv(n, block),)](
        param,
        momentum,
        # Never read when HAS_GRAD is False; any pointer of the right device keeps the signature fixed.
        momentum if grad is None else grad,
        n,
        float(h.prev_c),
        float(h.beta1),
        1.0 - h.beta1,
        float(h.nu_beta2),
        1.0 - h.nu_beta2,
        float(h.eps),
        # The ref skips the multiply when wd == 0; multiplying by exactly 1.0 changes nothing.
        h.decay,
        -h.lr / c,
        BLOCK=block,
        HAS_GRAD=grad is not None,
        num_warps=4,
        # No fp contraction: every op rounds on its own as in the ref (its fmas are explicit tl.fma).
        enable_fp_fusion=False,
    )
