"""What each method sends in a step: the collectives, from the engine's layout and the package's byte formulas.

DDP all-reduces its gradient buckets during the backward pass (fp32, or bf16 with PyTorch's
``bf16_compress_hook``). SCAPE's collectives follow :class:`~lightning_scape.engine.scape_engine.ScapeEngine`
step by step: the buckets of :func:`~lightning_scape.engine.layout.build_buckets`, the slots per chunk of
:meth:`~lightning_scape.config.ScapeConfig.slots_at`, and the mask schedule of
:class:`~lightning_scape.engine.masks.MaskSchedule` (which step builds which mask, and when its index
all-gather is waited on). Buckets of the same shape are counted together, so a model of any size is quick.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_scape.comm.int8_packets import packet_bytes
from lightning_scape.config import ScapeConfig, int8_dense_group
from lightning_scape.engine.layout import Bucket, build_buckets
from lightning_scape.planning.network import Collective, CollectiveKind

# A parameter count is laid out as parameters of this many elements (a transformer's matrices are 1-50M;
# the bucket boundaries, and so the padding, move a little with it).
SYNTHETIC_PIECE = 1 << 20
INDEX_ITEMSIZE = 2  # int16 chunk-local mask indices

# (padded elements, chunk size, chunks per shard, bytes per value) of a bucket -> (elements, bytes per element).
NumelOf = Callable[[int, int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class StepTraffic:
    """The collectives of one step of one rank, by when they are waited on.

    Attributes:
        backward: Launched bucket by bucket as the gradients arrive (they overlap the rest of the backward
            pass), in launch order.
        after: Waited on in the optimizer step: the clipping scalar, the parameter all-gathers.
        next_forward: Waited on when the next step launches its first bucket: the mask index all-gathers,
            which overlap the next forward pass.
    """

    backward: tuple[Collective, ...] = ()
    after: tuple[Collective, ...] = ()
    next_forward: tuple[Collective, ...] = ()

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """All of them."""
        return self.backward + self.after + self.next_forward

    def bytes_sent(self, world_size: int) -> int:
        """Bytes this rank sends in the step (what the package's ``ByteCounters`` count)."""
        return sum(c.bytes_sent(world_size) for c in self.collectives)

    def by_traffic(self, world_size: int) -> dict[str, int]:
        """Bytes sent per kind of traffic (``"dense"``, ``"values"``, ``"params"``, ``"indices"``, ``"scalars"``)."""
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.traffic] = out.get(c.traffic, 0) + c.bytes_sent(world_size)
        return out


def int8_packets(slices: int, numel: int, group: int) -> tuple[int, int]:
    """``slices`` int8 packets of ``numel`` values in groups of ``group``, as (elements, bytes per element)."""
    return slices * packet_bytes(numel, group), 1


def parameter_groups(
    model: torch.nn.Module | None = None, numel: int | None = None, dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """One param group: a model's trainable parameters, or ``numel`` meta-device parameters (no memory).

    Args:
        model: A model (on any device, the meta device included).
        numel: A parameter count, laid out in pieces of :data:`SYNTHETIC_PIECE` elements; used without a model.
        dtype: The synthetic parameters' dtype.
    """
    if model is not None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    if numel is None or numel < 1:
        raise ValueError(f"Give a model or a parameter count >= 1, got numel={numel!r}.")
    whole, rest = divmod(numel, SYNTHETIC_PIECE)
    sizes = [SYNTHETIC_PIECE] * whole + ([rest] if rest else [])
    return [{"params": [torch.nn.Parameter(torch.empty(n, dtype=dtype, device="meta")) for n in sizes]}]


def scape_layout(param_groups: list[dict[str, Any]], world_size: int, config: ScapeConfig) -> list[Bucket]:
    """The engine's buckets for these param groups on ``world_size`` ranks (gradient order: launch order)."""
    order = [p for g in param_groups for p in g["params"]]
    return build_buckets(param_groups, world_size, config.chunk_size, config.bucket_cap_mb, order)


def ddp_bucket_numels(param_groups: list[dict[str, Any]], bucket_cap_mb: float) -> list[tuple[int, int]]:
    """(elements, bytes per element) of DDP's gradient buckets: every parameter in launch order, cut at the cap.

    DDP buckets ignore param groups and pad nothing; the engine's layout function, on one group and one
    rank with chunks of one element, cuts them the same way.
    """
    params = [p for g in param_groups for p in g["params"]]
    buckets = build_buckets([{"params": params}], 1, 1, bucket_cap_mb, params)
    return [(b.numel, b.dtype.itemsize) for b in buckets]


def _grouped(items: Iterable[tuple[Any, ...]]) -> list[tuple[tuple[Any, ...], int]]:
    """Equal items counted, each group placed where its last member is (the last launched stays last)."""
    items = list(items)
    last = {item: i for i, item in enumerate(items)}
    counts: dict[tuple[Any, ...], int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return [(item, counts[item]) for item in sorted(last, key=lambda it: last[it])]


def ddp_traffic(buckets: Sequence[tuple[int, int]], itemsize: int | None = None) -> StepTraffic:
    """DDP's step: one all-reduce per bucket during the backward pass.

    Args:
        buckets: From :func:`ddp_bucket_numels`.
        itemsize: Bytes per value on the wire (2 for the bf16 hook); default: the gradients' own.
    """
    shapes = _grouped((numel, itemsize or size) for numel, size in buckets)
    return StepTraffic(backward=tuple(Collective("all_reduce", "dense", n, b, count) for (n, b), count in shapes))


class ScapeTraffic:
    """The collectives of a SCAPE run, step by step, as the engine issues them.

    Args:
        layout: The engine's buckets (:func:`scape_layout`).
        config: The configuration.
        clip: Whether the steps clip the global gradient norm (one fp32 scalar all-reduce per step, sharded).
    """

    def __init__(self, layout: Sequence[Bucket], config: ScapeConfig, clip: bool = True) -> None:
        if not layout:
            raise ValueError("The layout has no buckets: there are no trainable parameters.")
        self.config = config
        self.clip = clip
        # (padded elements, chunk size, chunks per shard, bytes per value) per group of equal buckets.
        self.shapes = _grouped((b.padded_numel, b.chunk_size, b.chunks_per_shard, b.dtype.itemsize) for b in layout)

    @property
    def schedule_steps(self) -> int:
        """The steps before the density is constant: the dense warm-up and the ramp."""
        cfg = self.config
        return cfg.dense_warmup_steps + (cfg.density_ramp_steps if cfg.dense_warmup_steps else 0)

    def steps(self, count: int) -> Iterator[StepTraffic]:
        """Steps 1 to ``count``."""
        for t in range(1, count + 1):
            yield self._dense_step(t) if t <= self.config.dense_steps else self._sparse_step(t)

    def steady_state(self) -> list[StepTraffic]:
        """The step that repeats once the schedule is over (a list of one): every sparse step after it is alike."""
        return [self._sparse_step(self.schedule_steps + 2)]

    # ------------------------------------------------------------------ one step

    def _scalars(self) -> tuple[Collective, ...]:
        sharded = self.config.sharded and self.clip
        return (Collective("all_reduce", "scalars", 1, 4),) if sharded else ()

    def _each(self, kind: CollectiveKind, traffic: str, numel_of: NumelOf) -> tuple[Collective, ...]:
        """One collective per bucket shape, of the size ``numel_of`` gives."""
        out = []
        for (padded, C, per_shard, itemsize), count in self.shapes:
            numel, size = numel_of(padded, C, per_shard, itemsize)
            out.append(Collective(kind, traffic, numel, size, count))
        return tuple(out)

    def _indices(self, for_step: int) -> tuple[Collective, ...]:
        """The index all-gathers of masks built for ``for_step`` (none when every rank computes every mask)."""
        if self.config.masks_built_locally:
            return ()
        slots = self.config.slots_at
        return self._each("all_gather", "indices", lambda p, c, n, b: (n * slots(for_step, c), INDEX_ITEMSIZE))

    def _dense_step(self, t: int) -> StepTraffic:
        cfg = self.config
        nxt: tuple[Collective, ...] = ()
        if t == cfg.dense_steps and cfg.mask_delay > 0:  # the end of the warm-up builds the first masks
            nxt = self._indices(t + 1)
        if not cfg.sharded:
            return StepTraffic(backward=self._each("all_reduce", "dense", lambda p, c, n, b: (p, b)), next_forward=nxt)
        if cfg.wire_format == "int8":

            def every_shard(p: int, c: int, n: int, b: int) -> tuple[int, int]:
                return int8_packets(p // (n * c), n * c, int8_dense_group(n * c))

            def own_shard(p: int, c: int, n: int, b: int) -> tuple[int, int]:
                return int8_packets(1, n * c, int8_dense_group(n * c))

            grads = self._each("reduce_scatter", "dense", every_shard)
            params = self._each("all_gather", "dense", own_shard)
        else:
            grads = self._each("reduce_scatter", "dense", lambda p, c, n, b: (p, b))
            params = self._each("all_gather", "dense", lambda p, c, n, b: (n * c, b))
        return StepTraffic(backward=grads, after=self._scalars() + params, next_forward=nxt)

    def _sparse_step(self, t: int) -> StepTraffic:
        """Step t sends at the mask built for it: in its backward pass (``mask_delay=0``), or at the end of step t - 1
        (the first one at the end of the warm-up, or at construction without one)."""
        cfg = self.config
        # mask_delay=0: built in the backward pass from this step's gradient, and waited on at once.
        after = self._indices(t) if cfg.mask_delay == 0 else ()
        slots = cfg.slots_at
        if cfg.wire_format == "int8":
            k = lambda c: slots(t, c)  # noqa: E731
            backward = self._each(
                "reduce_scatter", "values", lambda p, c, n, b: int8_packets(p // (n * c), n * k(c), k(c))
            )
            gather = self._each("all_gather", "params", lambda p, c, n, b: int8_packets(1, n * k(c), k(c)))
            after += self._scalars() + gather
        elif cfg.sharded:
            backward = self._each("reduce_scatter", "values", lambda p, c, n, b: (p // c * slots(t, c), b))
            gather = self._each("all_gather", "params", lambda p, c, n, b: (n * slots(t, c), b))
            after += self._scalars() + gather
        else:
            backward = self._each("all_reduce", "values", lambda p, c, n, b: (p // c * slots(t, c), b))
        nxt: tuple[Collective, ...] = ()
        if cfg.mask_delay > 0:  # the end of the step builds the mask of the next step
            nxt = self._indices(t + 1)
        return StepTraffic(backward=backward, after=after, next_forward=nxt)
