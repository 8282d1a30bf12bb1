"""Decoupled weight decay on the whole replica, then the owners' new values scattered at the mask."""

from __future__ import annotations

import torch
from torch import Tensor

from ._positions import mask_positions
from ._signature import signature_of
from ._triton import HAS_TRITON, LOW_FLOATS, cast_rne, chunk_ok, require_triton, slot_block, tl, triton, use_triton


def scatter_decay_ref(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: float) -> None:
    """Pure-PyTorch reference (and CPU path): ``params *= decay; params[mask] = values``.

    The op's signature is this one: its launcher and entry point are declared with it (``_signature.py``).

    Args:
        params: ``[rows * chunk_size]`` flat parameter replica, updated in place.
        values: ``[rows * k]`` new parameter values at the mask, in mask order.
        mask: ``[rows, k]`` int16 chunk-local indices.
        chunk_size: Coordinates per chunk.
        decay: ``1 - lr * weight_decay``.
    """
    if decay != 1.0:
        params.mul_(decay)
    params.index_copy_(0, mask_positions(mask, chunk_size), values.to(params.dtype))


@signature_of(scatter_decay_ref)
def scatter_decay(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: float) -> None:
    """Weight decay on the replica and scatter of the new values: the entry point (see :func:`scatter_decay_ref`).

    Runs :func:`scatter_decay_triton` where :func:`~._triton.use_triton` allows it and the kernel takes the
    chunk size and dtypes, :func:`scatter_decay_ref` otherwise. fp64 parameters run the ref (the kernel
    would apply ``decay`` rounded to fp32).
    """
    if (
        use_triton(params, values, mask)
        and chunk_ok(chunk_size)
        and params.dtype in LOW_FLOATS
        and values.is_floating_point()
    ):
        scatter_decay_triton(params, values, mask, chunk_size, decay)
    else:
        scatter_decay_ref(params, values, mask, chunk_size, decay)


if HAS_TRITON:
    # k is not specialized, as in ef_compact (docs/kernels.md, "Compile time").
    @triton.jit(do_not_specialize=["k"])
    def _scatter_decay_kernel(
        p_ptr: tl.tensor,
        v_ptr: tl.tensor,
        mask_ptr: tl.tensor,
        k: tl.tensor,
        decay: tl.tensor,
        C: tl.constexpr,
        BLOCK: tl.constexpr,
        SLOT_BLOCK: tl.constexpr,
        DECAY: tl.constexpr,
    ) -> None:
        # One program per chunk row: decay the whole chunk, then overwrite its k slots.
        row = tl.program_id(0).to(tl.int64)
        base = row * C
        if DECAY:
            for start in tl.static_range(0, C, BLOCK):
                offs = base + start + tl.arange(0, BLOCK)
                p = tl.load(p_ptr + offs)
                # The ref multiplies in the parameter dtype's op-math (fp32 for bf16/fp16) and rounds.
                tl.store(p_ptr + offs, cast_rne(p.to(tl.float32) * decay, p_ptr.dtype.element_ty))
            # The slot stores below must land after the decayed stores of the same addresses, which
            # other threads of this program issued: order them with a barrier.
            tl.debug_barrier()
        for s0 in range(0, k, SLOT_BLOCK):
            j = s0 + tl.arange(0, SLOT_BLOCK)
            live = j < k
            idx = tl.load(mask_ptr + row * k + j, mask=live, other=0).to(tl.int64)
            v = tl.load(v_ptr + row * k + j, mask=live)
            tl.store(p_ptr + base + idx, cast_rne(v, p_ptr.dtype.element_ty), mask=live)


@signature_of(scatter_decay_ref)
def scatter_decay_triton(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: float) -> None:
    """Triton kernel of :func:`scatter_decay_ref`: one pass over the replica, decay and scatter fused.

    Bit-for-bit equal to the ref for fp32, bf16 and fp16 parameters (``decay`` travels as fp32, as the
    ref applies it to those dtypes; fp64 parameters are left to the ref by the dispatcher).

    Args:
        params: ``[rows * chunk_size]`` contiguous flat parameter replica, updated in place.
        values: ``[rows * k]`` contiguous new values at the mask, in mask order.
        mask: ``[rows, k]`` contiguous int16 chunk-local indices (distinct within a row).
        chunk_size: Coordinates per chunk, a power of two.
        decay: ``1 - lr * weight_decay``; 1.0 skips the dense pass (only the k slots are written).
    """
    require_triton()
    if mask.dim() != 2 or mask.dtype != torch.int16:
        raise ValueError(f"mask must be [rows, k] int16, got {tuple(mask.shape)} {mask.dtype}")
    rows, k = mask.shape
    if params.numel() != rows * chunk_size or values.numel() != rows * k:
        raise ValueError(
            f"params ({params.numel()}) must hold rows * chunk_size = {rows} * {chunk_size} values and "
            f"values ({values.numel()}) rows * k = {rows} * {k}"
        )
    if rows == 0 or (k == 0 and decay == 1.0):
        return
    block = min(chunk_size, 2048)
    _scatter_decay_kernel[(rows,)](
        params,
        values,
        mask,
        k,
        float(decay),
        C=chunk_size,
        BLOCK=block,
        SLOT_BLOCK=slot_block(k),
        DECAY=decay != 1.0,
        num_warps=4 if block <= 1024 else 8,
        # No fp contraction: every op rounds on its own as in the ref (its fmas are explicit tl.fma).
        enable_fp_fusion=False,
    )
