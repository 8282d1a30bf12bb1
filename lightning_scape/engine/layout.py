"""The flat layout: trainable parameters cut into buckets, shards and chunks.

A bucket holds parameters of one param group, dtype and device, in the order their gradients are
expected (reverse of the model's registration order, as DDP does). It is padded to a multiple of
``world_size * C`` and cut into ``world_size`` equal shards; rank r owns shard r of every bucket. C is the
configured ``chunk_size``, except in a model so small that this padding would exceed
:data:`MAX_PADDING_FRACTION` of its parameters: then the most padded buckets get chunks sized to the bucket
(:func:`fit_chunk_sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# The padding a model may carry, as a fraction of its parameter bytes. The dense steps reduce-scatter and
# all-gather whole buckets, padding included, so this bounds their bytes at 1.05x DDP's. Real models at the
# default chunk_size stay far below it; tiny ones get smaller chunks instead (docs/algorithm.md, "Small models").
MAX_PADDING_FRACTION = 0.05


@dataclass(frozen=True)
class ParamPlace:
    """Where one parameter lives in its bucket."""

    param: torch.nn.Parameter
    offset: int
    numel: int


@dataclass
class Bucket:
    """Geometry of one communication bucket."""

    index: int
    group_index: int
    dtype: torch.dtype
    device: torch.device
    places: list[ParamPlace] = field(default_factory=list)
    numel: int = 0  # real elements
    padded_numel: int = 0  # multiple of world_size * chunk_size
    world_size: int = 1
    chunk_size: int = 1  # this bucket's C: the configured chunk_size, or smaller (fit_chunk_sizes)

    @property
    def padding(self) -> int:
        """Zero elements after the real ones (sent by the dense warm-up like real ones)."""
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard."""
        return self.padded_numel // self.world_size

    @property
    def chunks_per_shard(self) -> int:
        """n_c: chunks in a shard."""
        return self.shard_numel // self.chunk_size

    @property
    def chunks(self) -> int:
        """Chunks in the whole bucket (``world_size * chunks_per_shard``)."""
        return self.padded_numel // self.chunk_size


def trainable_param_groups(
    param_groups: list[dict[str, object]],
) -> list[list[torch.nn.Parameter]]:
    """Per group, the trainable parameters, each parameter once over all groups (tied weights count once)."""
    seen: set[int] = set()
    out: list[list[torch.nn.Parameter]] = []
    for group in param_groups:
        params: list[torch.nn.Parameter] = []
        for p in group["params"]:  # type: ignore[attr-defined]
            if not isinstance(p, torch.nn.Parameter) or not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
        out.append(params)
    return out


def build_buckets(
    param_groups: list[dict[str, object]],
    world_size: int,
    chunk_size: int,
    bucket_cap_mb: float,
    param_order: list[torch.nn.Parameter] | None = None,
) -> list[Bucket]:
    """Assign every trainable parameter to a bucket.

    Args:
        param_groups: The optimizer's param groups.
        world_size: W.
        chunk_size: C.
        bucket_cap_mb: Target bucket size in MiB of parameter storage (a larger parameter gets a bucket
            of its own).
        param_order: The model's parameters in registration order (``list(model.parameters())``), used
            to predict the gradient order; default: the order of the param groups.

    Returns:
        Buckets ordered by when their last gradient is expected, which is the launch order.
    """
    groups = trainable_param_groups(param_groups)
    group_of = {id(p): gi for gi, ps in enumerate(groups) for p in ps}
    order = [p for ps in groups for p in ps]
    if param_order is not None:
        rank_in_model = {id(p): i for i, p in enumerate(param_order)}
        order.sort(key=lambda p: rank_in_model.get(id(p), -1))
    order.reverse()  # gradients arrive last-layer first
    open_buckets: dict[tuple[int, torch.dtype, torch.device], Bucket] = {}
    closed: list[tuple[int, Bucket]] = []
    last_seen: dict[int, int] = {}
    for pos, p in enumerate(order):
        if p.is_sparse:
            raise ValueError("SCAPE cannot flatten sparse parameters; use dense parameters.")
        key = (group_of[id(p)], p.dtype, p.device)
        cap = max(1, int(bucket_cap_mb * 2**20) // p.element_size())
        b = open_buckets.get(key)
        if b is not None and b.numel > 0 and b.numel + p.numel() > cap:
            closed.append((last_seen[id(b)], b))
            b = None
        if b is None:
            b = Bucket(index=-1, group_index=key[0], dtype=p.dtype, device=p.device)
            open_buckets[key] = b
        b.places.append(ParamPlace(p, b.numel, p.numel()))
        b.numel += p.numel()
        last_seen[id(b)] = pos
    closed.extend((last_seen[id(b)], b) for b in open_buckets.values())
    closed.sort(key=lambda item: item[0])
    buckets = [b for _, b in closed]
    for i, b in enumerate(buckets):
        b.index = i
        b.world_size = world_size
        _set_chunk_size(b, chunk_size)
    fit_chunk_sizes(buckets)
    return buckets


def padded_numel(numel: int, world_size: int, chunk_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size * chunk_size`` (at least one such unit)."""
    unit = world_size * chunk_size
    return max(1, math.ceil(numel / unit)) * unit


def _set_chunk_size(bucket: Bucket, chunk_size: int) -> None:
    bucket.chunk_size = chunk_size
    bucket.padded_numel = padded_numel(bucket.numel, bucket.world_size, chunk_size)


def fit_chunk_sizes(buckets: list[Bucket], max_padding: float = MAX_PADDING_FRACTION) -> None:
    """Size the chunks of the most padded buckets to the bucket, until the model's padding is within ``max_padding``.

    Nothing changes while the padding of all buckets together is at most ``max_padding`` of the parameter
    bytes (every model of more than a few hundred thousand parameters at the default chunk size). Otherwise,
    most padded bucket first, a bucket keeps its number of chunks per shard (m, at least 1) and gets the
    chunk size ``ceil(numel / (world_size * m))``, the smallest that holds it: its padding falls below
    ``world_size * m`` elements. These chunk sizes need not be powers of two (the Triton kernels that need
    one then run their references for that bucket: only tiny buckets are sized so). All ranks compute the
    same layout.

    Why not the largest power of two that keeps the padding within bounds: it makes the chunks of a tiny
    model tiny, each chunk must then send its one slot whether or not it holds anything large, and the
    sparse phase trains much worse (measured in ``docs/algorithm.md``, "Small models").

    Args:
        buckets: The buckets, each with its ``world_size``, ``numel`` and configured ``chunk_size`` set;
            changed in place.
        max_padding: The padding allowed, as a fraction of the parameter bytes.
    """

    def pad_bytes(b: Bucket) -> int:
        return b.padding * b.dtype.itemsize

    budget = max_padding * sum(b.numel * b.dtype.itemsize for b in buckets)
    total = sum(pad_bytes(b) for b in buckets)
    for b in sorted(buckets, key=lambda b: (-pad_bytes(b), b.index)):
        if total <= budget:
            return
        before = pad_bytes(b)
        chunks_per_shard = max(1, math.ceil(b.numel / (b.world_size * b.chunk_size)))
        _set_chunk_size(b, max(1, math.ceil(b.numel / (b.world_size * chunks_per_shard))))
        total += pad_bytes(b) - before
