"""The element-wise ops of a SCAPE step: Triton kernels on CUDA, pure-PyTorch references elsewhere.

Each op lives in its own module with three functions of one signature: the reference ``<op>_ref`` (the
semantics, the CPU path, and the definition of the signature), the Triton launcher ``<op>_triton`` beside
its kernel, and the dispatching entry point ``<op>`` the engine calls. The launcher and the entry point
are declared ``@signature_of(<op>_ref)`` (``_signature.py``), so mypy rejects any drift between the three.
The entry point runs

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

from ._hyper import AdamSHyper
from ._positions import MAX_CHUNK_SIZE, mask_positions
from ._triton import HAS_TRITON, INTERPRETED, use_triton
from .chunk_topk import (
    chunk_topk,
    chunk_topk_ref,
    chunk_topk_triton,
    mask_scores_ref,
    select_mask,
    select_mask_ref,
    select_mask_triton,
)
from .dense_adams import dense_adams, dense_adams_ref, dense_adams_triton
from .ef_compact import ef_compact, ef_compact_ref, ef_compact_triton
from .round_int8 import decode_int8, round_int8, round_int8_ref, round_int8_triton
from .scatter_decay import scatter_decay, scatter_decay_ref, scatter_decay_triton
from .sparse_adams import sparse_adams, sparse_adams_ref, sparse_adams_triton

__all__ = [
    "HAS_TRITON",
    "INTERPRETED",
    "MAX_CHUNK_SIZE",
    "AdamSHyper",
    "chunk_topk",
    "chunk_topk_ref",
    "chunk_topk_triton",
    "decode_int8",
    "dense_adams",
    "dense_adams_ref",
    "dense_adams_triton",
    "ef_compact",
    "ef_compact_ref",
    "ef_compact_triton",
    "mask_positions",
    "mask_scores_ref",
    "round_int8",
    "round_int8_ref",
    "round_int8_triton",
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
