"""Error feedback + compaction: ``a = e + g; v = a[mask]; e = a; e[mask] -= v``, in one pass.

The residual ``e`` keeps whatever the compact buffer did not carry: the unmasked coordinates whole, and
at masked coordinates the rounding error of casting ``a`` to the communication dtype (zero in fp32). So
for every coordinate, the local gradient summed over steps equals what was sent plus the residual.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._positions import mask_positions
from ._signature import signature_of
from ._triton import HAS_TRITON, cast_rne, chunk_ok, require_triton, slot_block, tl, triton, use_triton

# Residual dtypes the kernel takes: it only adds and casts, so it is exact in fp64 too.
_STATE_FLOATS = (torch.float32, torch.float64)


def ef_compact_ref(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> None:
    """Pure-PyTorch reference (and CPU path).

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        residual: ``[rows * chunk_size]`` error-feedback residual (fp32 or fp64), updated in place.
        grad: Same shape, this step's local gradient (any float dtype).
        mask: ``[rows, k]`` int16 chunk-local indices.
        chunk_size: Coordinates per chunk.
        out: ``[rows * k]`` compact buffer in the communication dtype, written in mask order.
    """
    residual.add_(grad)
    pos = mask_positions(mask, chunk_size)
    picked = residual.index_select(0, pos)
    out.copy_(picked)
    residual.index_copy_(0, pos, picked.sub_(out.to(residual.dtype)))


@signature_of(ef_compact_ref)
def ef_compact(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> None:
    """Error feedback and compaction: the entry point (see :func:`ef_compact_ref` for the arguments).

    Runs :func:`ef_compact_triton` where :func:`~._triton.use_triton` allows it and the kernel takes the
    chunk size and dtypes, :func:`ef_compact_ref` otherwise. The kernel is exact for every dtype (it only
    adds and casts), fp64 included.
    """
    if (
        use_triton(residual, grad, mask, out)
        and chunk_ok(chunk_size)
        and residual.dtype in _STATE_FLOATS
        and grad.is_floating_point()
        and out.is_floating_point()
    ):
        ef_compact_triton(residual, grad, mask, chunk_size, out)
    else:
        ef_compact_ref(residual, grad, mask, chunk_size, out)


if HAS_TRITON:
    # k is not specialized (docs/kernels.md, "Compile time"): the density ramp's k would compile a variant for
    # each of Triton's classes of an int (1, divisible by 16, other), and it only addresses the slots (k indices
    # and k values per chunk, a small part of the bytes; the residual's are gathered anyway).
    @triton.jit(do_not_specialize=["k"])
    def _ef_compact_kernel(
        res_ptr: tl.tensor,
        grad_ptr: tl.tensor,
        mask_ptr: tl.tensor,
        out_ptr: tl.tensor,
        k: tl.tensor,
        C: tl.constexpr,
        BLOCK: tl.constexpr,
        SLOT_BLOCK: tl.constexpr,
    ) -> None:
        # One program per chunk row. Phase 1 streams the chunk once: e = e + g.
        row = tl.program_id(0).to(tl.int64)
        base = row * C
        for start in tl.static_range(0, C, BLOCK):
            offs = base + start + tl.arange(0, BLOCK)
            e = tl.load(res_ptr + offs)
            g = tl.load(grad_ptr + offs).to(e.dtype)
            tl.store(res_ptr + offs, e + g)
        # Phase 2 re-reads a = e + g at the slots, which other threads of this program wrote in phase 1:
        # the barrier makes those stores visible (and they are still in L1/L2, so this is not a 2nd pass).
        tl.debug_barrier()
        for s0 in range(0, k, SLOT_BLOCK):
            j = s0 + tl.arange(0, SLOT_BLOCK)
            live = j < k
            idx = tl.load(mask_ptr + row * k + j, mask=live, other=0).to(tl.int64)
            a = tl.load(res_ptr + base + idx, mask=live, other=0.0)
            v = cast_rne(a, out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * k + j, v, mask=live)
            # The rounding error of the cast to the communication dtype stays in the residual.
            tl.store(res_ptr + base + idx, a - v.to(a.dtype), mask=live)


@signature_of(ef_compact_ref)
def ef_compact_triton(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> None:
    """Triton kernel of :func:`ef_compact_ref` (same arguments, same result bit for bit).

    One program per chunk reads e and g once, writes e once, then compacts the k slots of its chunk.

    Args:
        residual: ``[rows * chunk_size]`` contiguous residual (fp32 or fp64), updated in place.
        grad: Same shape, contiguous, any float dtype.
        mask: ``[rows, k]`` contiguous int16 chunk-local indices (distinct within a row).
        chunk_size: Coordinates per chunk, a power of two.
        out: ``[rows * k]`` contiguous compact buffer.
    """
    require_triton()
    rows, k = _check(residual, grad, mask, chunk_size, out)
    if rows == 0 or k == 0:
        return
    block = min(chunk_size, 2048)
    _ef_compact_kernel[(rows,)](
        residual,
        grad,
        mask,
        out,
        k,
        C=chunk_size,
        BLOCK=block,
        SLOT_BLOCK=slot_block(k),
        num_warps=4 if block <= 1024 else 8,
        # No fp contraction: every op rounds on its own as in the ref (its fmas are explicit tl.fma).
        enable_fp_fusion=False,
    )


def _check(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> tuple[int, int]:
    """Shape checks a kernel needs (it does no bounds checking of its own); returns ``(rows, k)``."""
    if mask.dim() != 2 or mask.dtype != torch.int16:
        raise ValueError(f"mask must be [rows, k] int16, got {tuple(mask.shape)} {mask.dtype}")
    rows, k = mask.shape
    if residual.numel() != rows * chunk_size or grad.numel() != residual.numel():
        raise ValueError(
            f"residual ({residual.numel()}) and grad ({grad.numel()}) must hold rows * chunk_size = "
            f"{rows} * {chunk_size} values"
        )
    if out.numel() != rows * k:
        raise ValueError(f"out holds {out.numel()} values, the mask has {rows} * {k} slots")
    return rows, k
