"""Rounding to int8 with one absmax scale per group, the rounding error left in the input.

``s = max|x| / 127`` per group of ``group`` consecutive values, ``q = rne(x / s)`` (0 where ``s = 0``) and
``x -= q * s``: what travels is ``(q, s)``, and ``x`` keeps the rounding error, so a caller that adds it back to
its error-feedback residual loses no gradient mass. ``q * s`` is what every receiver decodes, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._signature import signature_of
from ._triton import HAS_TRITON, require_triton, tl, triton, use_triton

INT8_MAX = 127  # symmetric codes: -127..127, so that -q is always a code


def round_int8_ref(x: Tensor, group: int, codes: Tensor, scales: Tensor) -> None:
    """Pure-PyTorch reference (and CPU path).

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        x: ``[groups * group]`` fp32 values, replaced in place by their rounding error ``x - q * s``.
        group: Values per scale.
        codes: ``[groups * group]`` int8 output ``q``.
        scales: ``[groups]`` fp32 output ``s = max|x| / 127`` of each group.
    """
    rows = x.view(-1, group)
    # The scale is fp32 (what travels), and the error is taken against the fp32 q * s every receiver decodes, so
    # an fp64 x keeps its exact rounding error too.
    amax = rows.abs().amax(dim=1).float()
    s = amax / torch.full_like(amax, INT8_MAX)  # a tensor divisor: CUDA divides by a scalar as a reciprocal multiply
    q = rows.float().div(torch.where(s > 0, s, 1.0).unsqueeze(1)).round_().clamp_(-INT8_MAX, INT8_MAX)
    rows.sub_(q * s.unsqueeze(1))
    codes.copy_(q.view(-1))
    scales.copy_(s)


def decode_int8(codes: Tensor, scales: Tensor, out: Tensor | None = None) -> Tensor:
    """``q * s`` per group: the fp32 values every receiver of ``(codes, scales)`` computes.

    Args:
        codes: ``[..., groups * group]`` int8 codes; the rows may be strided (views into packets).
        scales: ``[..., groups]`` fp32 scales, one per group of each row of ``codes``.
        out: ``codes``' shape in fp32, contiguous, to write into; a new tensor where None.

    Returns:
        ``out``: the decoded values.
    """
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    groups = scales.shape[-1]
    # One multiplication: the code is promoted to fp32 (exactly) and multiplied in fp32, as ``q.float() * s``.
    torch.mul(codes.unflatten(-1, (groups, -1)), scales.unsqueeze(-1), out=out.unflatten(-1, (groups, -1)))
    return out


@signature_of(round_int8_ref)
def round_int8(x: Tensor, group: int, codes: Tensor, scales: Tensor) -> None:
    """Int8 rounding with the error left in ``x``: the entry point (see :func:`round_int8_ref`).

    Runs :func:`round_int8_triton` where :func:`~._triton.use_triton` allows it and ``x`` is fp32,
    :func:`round_int8_ref` otherwise.
    """
    if use_triton(x, codes, scales) and x.dtype == torch.float32 and 0 < group <= _MAX_GROUP:
        round_int8_triton(x, group, codes, scales)
    else:
        round_int8_ref(x, group, codes, scales)


_MAX_GROUP = 8192  # one program holds a group in registers

if HAS_TRITON:

    @triton.jit
    def _round_int8_kernel(
        x_ptr: tl.tensor,
        codes_ptr: tl.tensor,
        scales_ptr: tl.tensor,
        group: tl.tensor,
        BLOCK: tl.constexpr,
    ) -> None:
        # One program per group: read it once, write the codes, the scale and the error.
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        live = j < group
        offs = row * group + j
        x = tl.load(x_ptr + offs, mask=live, other=0.0)
        s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
        ratio = tl.math.div_rn(x, tl.where(s > 0, s, 1.0))
        # Adding and subtracting 1.5 * 2**23 rounds an fp32 below 2**22 in magnitude to the nearest integer, ties
        # to even (torch.round's rule), by two IEEE additions that the GPU and the interpreter compute alike.
        q = (ratio + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(codes_ptr + offs, q.to(tl.int8), mask=live)
        tl.store(scales_ptr + row, s)
        tl.store(x_ptr + offs, x - q * s, mask=live)


@signature_of(round_int8_ref)
def round_int8_triton(x: Tensor, group: int, codes: Tensor, scales: Tensor) -> None:
    """Triton kernel of :func:`round_int8_ref` (same arguments, same result bit for bit; fp32 ``x``).

    One program per group of at most 8192 values reads ``x`` once and writes codes, scale and error.
    """
    require_triton()
    groups = _check(x, group, codes, scales)
    if groups == 0:
        return
    block = triton.next_power_of_2(group)
    _round_int8_kernel[(groups,)](
        x,
        codes,
        scales,
        group,
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
        # No fp contraction: q * s and x - q * s round separately, as in the ref.
        enable_fp_fusion=False,
    )


def _check(x: Tensor, group: int, codes: Tensor, scales: Tensor) -> int:
    """Shape checks the kernel needs (it does no bounds checking of its own); returns the number of groups."""
    if group <= 0 or x.numel() % group:
        raise ValueError(f"x holds {x.numel()} values, not a whole number of groups of {group}")
    groups = x.numel() // group
    if codes.numel() != x.numel() or codes.dtype != torch.int8:
        raise ValueError(f"codes must be {x.numel()} int8 values, got {codes.numel()} x {codes.dtype}")
    if scales.numel() != groups or scales.dtype != torch.float32:
        raise ValueError(f"scales must be {groups} fp32 values, got {scales.numel()} x {scales.dtype}")
    return groups
