"""A rank's SCAPE state in a checkpoint: what is saved, what must match to load it, and loading it.

The state holds this rank's momentum region, residual, last-sent steps, queued and last-built masks, the
step and refresh counters and the byte counters; the parameters are the model's and are saved with it.
Every rank saves and loads its own. Loading checks everything first and changes nothing on a mismatch.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_scape.engine.masks import Mask

if TYPE_CHECKING:
    from lightning_scape.engine import ScapeEngine

# Version 2: masks are saved as their indices alone, and the byte counters without received bytes.
STATE_VERSION = 2
# Fields that may differ between the run that saved a state and the one that loads it.
_RESUMABLE_CHANGES = frozenset({"collective_timeout_s"})


def engine_state(engine: ScapeEngine) -> dict[str, Any]:
    """This rank's SCAPE state (waits for masks still being gathered)."""
    engine.masks.wait_all()
    masks = engine.masks
    return {
        "version": STATE_VERSION,
        "config": engine.config.to_dict(),
        "world_size": engine.world_size,
        "rank": engine.rank,
        "layout": _layout(engine),
        "step_count": engine.step_count,
        "refresh_count": masks.refresh_count,
        "counters": engine.counters.state_dict(),
        "buckets": [
            {
                "momentum": bs.momentum.clone(),
                "residual": bs.residual.clone(),
                "last_sent": bs.last_sent.clone(),
                "masks": [m.indices.clone() for m in masks.queues[i]],
                "last_built": None if (lb := masks.last_built[i]) is None else lb.indices.clone(),
            }
            for i, bs in enumerate(engine.buckets)
        ],
    }


def check_engine_state(engine: ScapeEngine, state: Any) -> None:
    """Raise ``ValueError`` unless :func:`load_engine_state` can restore ``state`` exactly; changes nothing.

    Checks the format version, world size and rank, the configuration (``collective_timeout_s`` may differ),
    the bucket layout, and the shape and dtype of every saved tensor.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"SCAPE state has format version {found!r}; this lightning_scape reads version {STATE_VERSION}. Resume "
            "with the lightning_scape version that wrote the checkpoint, or start a new run from its model weights."
        )
    if state["world_size"] != engine.world_size or state["rank"] != engine.rank:
        raise ValueError(
            f"SCAPE state was saved by rank {state['rank']} of {state['world_size']}, but this is rank "
            f"{engine.rank} of {engine.world_size}; resume on the same world size."
        )
    mine = engine.config.to_dict()
    diff = {
        k: (state["config"].get(k), v)
        for k, v in mine.items()
        if k not in _RESUMABLE_CHANGES and state["config"].get(k) != v
    }
    if diff:
        raise ValueError(
            f"SCAPE state comes from another configuration (field: (saved, current)): {diff}. Resume with "
            "the configuration the checkpoint was written with."
        )
    saved_layout = [tuple(x) for x in state["layout"]]
    if saved_layout != _layout(engine) or len(state["buckets"]) != len(engine.buckets):
        raise ValueError(
            "SCAPE state has another bucket layout (model, param groups or bucket_cap_mb changed): "
            f"saved {saved_layout}, current {_layout(engine)}."
        )
    for i, (bs, saved) in enumerate(zip(engine.buckets, state["buckets"], strict=True)):
        k_min, k_max = engine.config.slots_for(bs.layout.chunk_size), engine.config.max_slots(bs.layout.chunk_size)
        for name, t in (("momentum", bs.momentum), ("residual", bs.residual), ("last_sent", bs.last_sent)):
            got = saved[name]
            if not isinstance(got, Tensor) or got.shape != t.shape or got.dtype != t.dtype:
                desc = (got.dtype, tuple(got.shape)) if isinstance(got, Tensor) else type(got).__name__
                raise ValueError(f"SCAPE state: bucket {i} {name} is {desc}, expected {(t.dtype, tuple(t.shape))}.")
        masks = list(saved["masks"]) + ([] if saved["last_built"] is None else [saved["last_built"]])
        for ix in masks:
            fits = isinstance(ix, Tensor) and ix.dtype == torch.int16 and ix.dim() == 2
            if not fits or ix.shape[0] != bs.layout.chunks or not k_min <= ix.shape[1] <= k_max:
                raise ValueError(
                    f"SCAPE state: bucket {i} has a mask that is not int16 of shape ({bs.layout.chunks}, k) with "
                    f"{k_min} <= k <= {k_max}."
                )


@torch.no_grad()
def load_engine_state(engine: ScapeEngine, state: dict[str, Any]) -> None:
    """Restore :func:`engine_state`; refuses (changing nothing) a state that :func:`check_engine_state` rejects."""
    check_engine_state(engine, state)
    masks = engine.masks
    for i, (bs, saved) in enumerate(zip(engine.buckets, state["buckets"], strict=True)):
        bs.momentum.copy_(saved["momentum"])
        bs.residual.copy_(saved["residual"])
        bs.last_sent.copy_(saved["last_sent"])
        dev = bs.params.device
        masks.queues[i] = deque(Mask(ix.to(dev)) for ix in saved["masks"])
        lb = saved["last_built"]
        masks.last_built[i] = None if lb is None else Mask(lb.to(dev))
    engine.step_count = int(state["step_count"])
    masks.refresh_count = int(state["refresh_count"])
    engine.counters.load_state_dict(state["counters"])


def _layout(engine: ScapeEngine) -> list[tuple[int, int, int]]:
    return [(b.layout.group_index, b.layout.numel, b.layout.padded_numel) for b in engine.buckets]
