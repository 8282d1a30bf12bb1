"""The optional Triton import shared by the kernel modules, and the rules for when a kernel may run.

Triton is an optional dependency (``pip install lightning-scape[triton]``): without it every op runs its
pure-PyTorch reference. Each kernel module guards its ``@triton.jit`` definitions with ``HAS_TRITON``.

Triton decides at decoration time (that is, when ``lightning_scape.kernels`` is first imported) whether
a kernel is compiled for the GPU or run by its CPU interpreter (``TRITON_INTERPRET=1``); ``INTERPRETED``
records that decision so the dispatcher only hands CPU tensors to kernels that can run them.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from ._positions import MAX_CHUNK_SIZE

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import, and every op must work, without triton
    triton = None
    tl = None

HAS_TRITON: bool = triton is not None
INTERPRETED: bool = HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") == "1"

FORCE_REF_ENV = "LIGHTNING_SCAPE_FORCE_REF"
FORCE_TRITON_ENV = "LIGHTNING_SCAPE_FORCE_TRITON"

# Float dtypes whose loads, stores and rounding the kernels reproduce exactly. fp64 is left out of the
# kernels with scalar hyperparameters: Triton passes Python floats as fp32, while the refs apply them
# in fp64 to fp64 tensors, so those ops fall back to the refs for fp64.
LOW_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _env_on(name: str) -> bool:
    """Whether the environment variable ``name`` is ``"1"`` (read at every call, so tests can flip it)."""
    return os.environ.get(name, "0") == "1"


def use_triton(*tensors: Tensor) -> bool:
    """Whether an op on ``tensors`` should run its Triton kernel rather than its reference.

    Rules, in order: ``LIGHTNING_SCAPE_FORCE_REF=1`` or no triton -> reference. CUDA tensors -> Triton.
    CPU tensors -> Triton only when the kernels were decorated under ``TRITON_INTERPRET=1`` and
    ``LIGHTNING_SCAPE_FORCE_TRITON=1`` is set (so the engine can be tested on kernels without a GPU).
    All tensors must be contiguous and on one device (the kernels index flat memory).

    Args:
        tensors: Every tensor argument of the op.

    Returns:
        True to launch the Triton kernel.
    """
    if not HAS_TRITON or _env_on(FORCE_REF_ENV):
        return False
    dev = tensors[0].device
    on_gpu = dev.type == "cuda"
    interpreted_cpu = dev.type == "cpu" and INTERPRETED and _env_on(FORCE_TRITON_ENV)
    if not (on_gpu or interpreted_cpu):
        return False
    return all(t.device == dev and t.is_contiguous() for t in tensors)


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two (``tl.arange`` needs one)."""
    return n > 0 and (n & (n - 1)) == 0


def slot_block(k: int) -> int:
    """Slots per pass of the per-chunk kernels (``ef_compact``, ``scatter_decay``): k rounded up to a power of two,
    between 256 and 1024.

    A pass holds at least 256 slots, one per thread of a program of 8 warps: a smaller block would not take fewer
    instructions, and every k up to 256 (every density below 1/16 at C = 4096) then shares one compiled
    variant, so the density ramp compiles three rather than one per power of two (docs/kernels.md, "Compile
    time"). Which slots a pass holds changes nothing in the result: each slot is its own coordinate.
    """
    return min(1024, max(256, 1 << (max(k, 1) - 1).bit_length()))


def chunk_ok(chunk_size: int) -> bool:
    """Whether the chunked kernels take ``chunk_size``: a power of two (``tl.arange``) <= ``MAX_CHUNK_SIZE``."""
    return is_pow2(chunk_size) and chunk_size <= MAX_CHUNK_SIZE


if HAS_TRITON:

    @triton.jit
    def cast_rne(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
        """``x.to(dtype)`` with round-to-nearest-even, the rounding of ``Tensor.to`` in PyTorch.

        fp32 -> bf16 is done on the bit pattern: the GPU's own conversion rounds the same way, but
        Triton's CPU interpreter truncates, and the kernels must equal the refs bit for bit under the
        interpreter too. NaN becomes PyTorch's canonical bf16 NaN (0x7FC0). A few integer ops per
        element cost nothing in these memory-bound kernels.
        """
        if dtype == tl.bfloat16:
            f = x.to(tl.float32)
            bits = f.to(tl.uint32, bitcast=True)
            bits = tl.where(f != f, 0x7FC00000, bits).to(tl.uint32)
            rounded = bits + 0x7FFF + ((bits >> 16) & 1)
            return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

else:
    cast_rne = None


def require_triton() -> None:
    """Raise a clear error when a ``*_triton`` launcher is called without triton installed."""
    if not HAS_TRITON:
        raise RuntimeError(
            "triton is not installed: install lightning-scape[triton], or call the *_ref op / the "
            "dispatching op (which falls back to the ref)."
        )
