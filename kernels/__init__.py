"""The element-wise ops of a SCAPE step: Triton kernels on CUDA, pure-PyTorch references on the CPU.

Each op lives in its own module with its ``*_ref`` reference beside it. The names exported here are
the dispatching entry points the engine calls. Set ``LIGHTNING_SCAPE_FORCE_REF=1`` to run the
references on CUDA too (for debugging a kernel).
"""

from __future__ import annotations

from ._positions import mask_positions
from .chunk_topk import chunk_topk_ref, mask_scores_ref
from .dense_adams import dense_adams_ref
from .ef_compact import ef_compact_ref
from .scatter_decay import scatter_decay_ref
from .sparse_adams import sparse_adams_ref

ef_compact = ef_compact_ref
sparse_adams = sparse_adams_ref
mask_scores = mask_scores_ref
chunk_topk = chunk_topk_ref
scatter_decay = scatter_decay_ref
dense_adams = dense_adams_ref

__all__ = [
    "chunk_topk",
    "chunk_topk_ref",
    "dense_adams",
    "dense_adams_ref",
    "ef_compact",
    "ef_compact_ref",
    "mask_positions",
    "mask_scores",
    "mask_scores_ref",
    "scatter_decay",
    "scatter_decay_ref",
    "sparse_adams",
    "sparse_adams_ref",
]
