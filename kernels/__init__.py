"""The element-wise ops of a SCAPE step: Triton kernels on CUDA, pure-PyTorch references elsewhere.

Each op lives in its own module with its ``*_ref`` reference and its ``*_triton`` launcher beside it.
The names exported here without a suffix are the dispatching entry points the engine calls:

* the Triton launcher when triton imports and the tensors are CUDA, contiguous, of a dtype the kernel
  reproduces exactly (fp32/bf16/fp16 parameters with fp32 state; ``ef_compact`` and ``chunk_topk``
  also take fp64) and ``chunk_size`` is a power of two;
* the reference otherwise (CPU tensors, fp64 state, no triton).

``LIGHTNING_SCAPE_FORCE_REF=1`` runs the references on CUDA too (to debug a kernel).
``TRITON_INTERPRET=1`` (set before this package is imported) together with
``LIGHTNING_SCAPE_FORCE_TRITON=1`` runs the kernels on CPU tensors in Triton's interpreter, so the
engine can be tested on the kernels without a GPU. ``docs/kernels.md`` has the details.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._hyper import AdamSHyper
from ._positions import MAX_CHUNK_SIZE, mask_positions
from ._triton import HAS_TRITON, INTERPRETED, LOW_FLOATS, is_pow2, use_triton
from .chunk_topk import (
    chunk_topk_ref,
    chunk_topk_triton,
    mask_scores_ref,
    select_mask_ref,
    select_mask_triton,
)
from .dense_adams import dense_adams_ref, dense_adams_triton
from .ef_compact import ef_compact_ref, ef_compact_triton
from .scatter_decay import scatter_decay_ref, scatter_decay_triton
from .sparse_adams import sparse_adams_ref, sparse_adams_triton

_STATE_FLOATS = (torch.float32, torch.float64)


def _chunk_ok(chunk_size: int) -> bool:
    return is_pow2(chunk_size) and chunk_size <= MAX_CHUNK_SIZE


def ef_compact(residual: Tensor, grad: Tensor, mask: Tensor, chunk_size: int, out: Tensor) -> None:
    """Error feedback and compaction (see :func:`ef_compact_ref` for the arguments).

    The kernel is exact for every dtype (it only adds and casts), fp64 included.
    """
    if (
        use_triton(residual, grad, mask, out)
        and _chunk_ok(chunk_size)
        and residual.dtype in _STATE_FLOATS
        and grad.is_floating_point()
        and out.is_floating_point()
    ):
        ef_compact_triton(residual, grad, mask, chunk_size, out)
    else:
        ef_compact_ref(residual, grad, mask, chunk_size, out)


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
    """AdamS on the masked slots (see :func:`sparse_adams_ref`); fp64 state runs the ref."""
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


def chunk_topk(scores: Tensor, chunk_size: int, k: int, k_explore: int, explore_offset: int) -> Tensor:
    """Per-chunk top-k with exploration (see :func:`chunk_topk_ref`); the kernel returns the same indices."""
    if use_triton(scores) and _chunk_ok(chunk_size) and scores.is_floating_point():
        return chunk_topk_triton(scores, chunk_size, k, k_explore, explore_offset)
    return chunk_topk_ref(scores, chunk_size, k, k_explore, explore_offset)


def select_mask(
    momentum: Tensor,
    residual: Tensor,
    beta1: float,
    statistic: str,
    chunk_size: int,
    k: int,
    k_explore: int,
    explore_offset: int,
) -> Tensor:
    """Score and select in one op: ``chunk_topk(mask_scores_ref(momentum, residual, ...), ...)``.

    See :func:`select_mask_ref`. fp32 state runs the fused kernel; fp64 state runs the ref (the
    score's ``b1`` would be rounded to fp32 in the kernel).
    """
    inputs = (momentum, residual) if statistic == "momentum" else (residual,)
    if (
        use_triton(*inputs)
        and _chunk_ok(chunk_size)
        and all(t.dtype == torch.float32 for t in inputs)
        and statistic in ("momentum", "gradient")
    ):
        return select_mask_triton(momentum, residual, beta1, statistic, chunk_size, k, k_explore, explore_offset)
    return select_mask_ref(momentum, residual, beta1, statistic, chunk_size, k, k_explore, explore_offset)


def scatter_decay(params: Tensor, values: Tensor, mask: Tensor, chunk_size: int, decay: float) -> None:
    """Weight decay on the replica and scatter of the new values (see :func:`scatter_decay_ref`).

    fp64 parameters run the ref (the kernel would apply ``decay`` rounded to fp32).
    """
    if (
        use_triton(params, values, mask)
        and _chunk_ok(chunk_size)
        and params.dtype in LOW_FLOATS
        and values.is_floating_point()
    ):
        scatter_decay_triton(params, values, mask, chunk_size, decay)
    else:
        scatter_decay_ref(params, values, mask, chunk_size, decay)


def dense_adams(param: Tensor, momentum: Tensor, grad: Tensor | None, hyper: AdamSHyper) -> None:
    """Dense AdamS, in place (see :func:`dense_adams_ref`); fp64 state runs the ref."""
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


__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "MAX_CHUNK_SIZE",
    "AdamSHyper",
    "chunk_topk",
    "chunk_topk_ref",
    "chunk_topk_triton",
    "dense_adams",
    "dense_adams_ref",
    "dense_adams_triton",
    "ef_compact",
    "ef_compact_ref",
    "ef_compact_triton",
    "mask_positions",
    "mask_scores_ref",
    "scatter_decay",
    "scatter_decay_ref",
    "scatter_decay_triton",
    "select_mask",
    "select_mask_ref",
    "select_mask_triton",
    "sparse_adams",
    "sparse_adams_ref",
    "sparse_adams_triton",
    "use_triton",
]
