"""The bytes a whole run sends, SCAPE's and DDP's, from the configuration and the engine's bucket layout.

The same ring formulas the engine counts its collectives with (:mod:`lightning_scape.comm.wire`), step by step
through the schedule: dense steps (the warm-up and the ramp's steps denser than 1/4), the ramp's sparse steps
at their own slots per chunk, then the final density. Scalars (the clipping norm, the fp16 finiteness vote)
are left out: a few bytes per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from lightning_scape.comm.int8_packets import packet_bytes
from lightning_scape.comm.wire import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
from lightning_scape.config import ScapeConfig, int8_dense_group
from lightning_scape.engine.layout import Bucket

_INDEX_BYTES = 2  # int16 chunk-local indices


def ddp_step_bytes(buckets: Sequence[Bucket], world_size: int) -> int:
    """What DDP's all-reduce of the real gradient sends per step and rank."""
    return sum(all_reduce_bytes(b.numel, b.dtype.itemsize, world_size) for b in buckets)


def dense_step_bytes(buckets: Sequence[Bucket], config: ScapeConfig, world_size: int) -> int:
    """A dense SCAPE step: reduce-scatter plus parameter all-gather (sharded), or an all-reduce, of the padding too."""
    total = 0
    for b in buckets:
        size = b.dtype.itemsize
        if config.wire_format == "int8":
            shard = b.padded_numel // world_size
            total += _int8_pair_bytes(shard, int8_dense_group(shard), world_size)
        elif config.sharded:
            total += reduce_scatter_bytes(b.padded_numel, size, world_size)
            total += all_gather_bytes(b.padded_numel // world_size, size, world_size)
        else:
            total += all_reduce_bytes(b.padded_numel, size, world_size)
    return total


def sparse_step_bytes(buckets: Sequence[Bucket], config: ScapeConfig, world_size: int, step: int) -> int:
    """A sparse step (1-based ``step``): the values at its mask and (sharded) the updated parameters."""
    total = 0
    for b in buckets:
        k = config.slots_at(step, b.chunk_size)
        slots = b.chunks * k
        size = b.dtype.itemsize
        if config.wire_format == "int8":
            total += _int8_pair_bytes(slots // world_size, k, world_size)
        elif config.sharded:
            total += reduce_scatter_bytes(slots, size, world_size)
            total += all_gather_bytes(slots // world_size, size, world_size)
        else:
            total += all_reduce_bytes(slots, size, world_size)
    return total


def _int8_pair_bytes(per_rank: int, group: int, world_size: int) -> int:
    """The int8 wire's reduce-scatter and all-gather of ``per_rank`` values per rank: a packet to each other rank,
    twice (``comm/int8_packets.py``)."""
    return 2 * (world_size - 1) * packet_bytes(per_rank, group)


def mask_bytes(buckets: Sequence[Bucket], config: ScapeConfig, world_size: int, step: int) -> int:
    """The indices of the masks built for sparse step ``step`` (none where every rank builds every mask)."""
    if config.masks_built_locally:
        return 0
    return sum(
        all_gather_bytes(b.chunks * config.slots_at(step, b.chunk_size) // world_size, _INDEX_BYTES, world_size)
        for b in buckets
    )


def run_bytes(buckets: Sequence[Bucket], config: ScapeConfig, world_size: int, steps: int) -> tuple[float, int]:
    """(SCAPE's bytes, DDP's bytes) per rank over ``steps`` optimizer steps.

    A mask is built for every sparse step, ``mask_delay`` steps ahead (the last one for the step after the run).

    Args:
        buckets: The engine's bucket layouts (``[bs.layout for bs in engine.buckets]``).
        config: The SCAPE configuration.
        world_size: The number of ranks.
        steps: The optimizer steps of the run.
    """
    if world_size < 2 or steps < 1:
        return 0.0, 0
    dense = min(steps, config.dense_steps)
    ramp_end = config.dense_warmup_steps + config.density_ramp_steps if config.dense_warmup_steps else 0

    def sparse(step: int) -> float:
        return sparse_step_bytes(buckets, config, world_size, step)

    scape = dense * dense_step_bytes(buckets, config, world_size) + _sum_steps(dense + 1, steps, ramp_end, sparse)
    masks_end = steps + config.mask_delay  # the last masks are built for the step after the run
    masks = functools.partial(mask_bytes, buckets, config, world_size)
    scape += _sum_steps(config.dense_steps + 1, masks_end, ramp_end, masks)
    return scape, steps * ddp_step_bytes(buckets, world_size)


def _sum_steps(first: int, last: int, ramp_end: int, per_step: Callable[[int], float]) -> float:
    """``per_step(s)`` summed over steps ``first..last``, one at a time on the ramp, then constant after it."""
    if last < first:
        return 0.0
    on_ramp = min(last, ramp_end)
    total = sum(per_step(s) for s in range(first, on_ramp + 1))
    flat = max(first, on_ramp + 1)
    return total + (last - flat + 1) * per_step(flat) if last >= flat else total
