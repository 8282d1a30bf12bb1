"""Switching the engine's form between steps: every step dense (fp32 or the int8 wire) or sparse after a ramp.

The mechanism only; which form to take, and when, is the pilot's (:class:`Pilot`): by default
:class:`lightning_scape.planning.pilot.FormPilot`, which measures the link and predicts each form's time to the
same loss. A switch keeps every invariant of the engine. No gradient mass is lost: sparse steps and the int8 wire
leave what they did not send in the residual, and the next fp32 dense step sends it with its gradient
(:attr:`~lightning_scape.engine.buckets.BucketState.residual_live`). Replicas stay identical: every rank switches
after the same step, from the same (all-reduced) measurements. A sparse form starts with the density ramp its
configuration gives (the pilot shortens it after a dense stretch); a dense form drops the masks in flight.

Where the pilot takes fp32 dense steps, or a fixed form sends every step dense in fp32, a sharded engine takes them
in DDP's form once it can
(:func:`take_ddp_form`): every rank holds the whole momentum, the gradient is all-reduced during the backward pass
and every rank updates every parameter, so the step ends without the parameter all-gather that sharded dense steps
wait for. It holds DDP + AdamS's optimizer memory (the momentum of every parameter, half of DDP + AdamW's) while
it runs, and gives the other ranks' shards back at the next switch, checkpoint load or new parameters
(:func:`shard_again`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_scape.config import ScapeConfig

if TYPE_CHECKING:
    from lightning_scape.engine.scape_engine import ScapeEngine


class Pilot(Protocol):
    """Chooses the engine's form during the run (``ScapeConfig.chooses_form``)."""

    def after_step(self, engine: ScapeEngine) -> None:
        """Called on every rank after every applied step; may call :func:`switch_form` (on every rank alike)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the pilot."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


_default_pilot: Callable[[], Pilot] | None = None


def set_default_pilot(factory: Callable[[], Pilot]) -> None:
    """The pilot an engine takes when its configuration leaves the form to SCAPE and none is given (the package
    sets :class:`~lightning_scape.planning.pilot.FormPilot` when it is imported)."""
    global _default_pilot
    _default_pilot = factory


def default_pilot() -> Pilot:
    """A new pilot from :func:`set_default_pilot`'s factory."""
    if _default_pilot is None:
        raise RuntimeError(
            "No pilot to choose SCAPE's form: import lightning_scape (which registers it), pass form_pilot= to "
            "ScapeEngine, or set wire_format= and density= in ScapeConfig to fix the form."
        )
    return _default_pilot()


def use_config(engine: ScapeEngine, config: ScapeConfig) -> None:
    """Make ``config`` the engine's form: what its steps, masks and buckets read (no collective)."""
    engine.config = config
    engine.masks.config = config
    for bs in engine.buckets:
        bs.int8_wire = config.wire_format == "int8"


def switch_form(engine: ScapeEngine, config: ScapeConfig) -> None:
    """Take ``config`` (a fixed form) from the next step on; every rank must call this after the same step.

    Masks in flight are waited for and dropped. A form whose next step is sparse builds its first masks now, from
    the momentum and residual: after dense steps every coordinate counts as sent now, as at the end of the warm-up;
    after sparse steps (another sparse form) each keeps the step it was last sent at.
    """
    if config.dense_steps > engine.step_count and not config.sharded and any(b.residual_live for b in engine.buckets):
        raise ValueError(
            "A replicated engine (sharded=False) cannot turn dense after sparse steps: its dense steps reuse the "
            "residual's memory, which still holds gradient not sent. Use sharded=True."
        )
    engine.masks.drop()
    shard_again(engine)
    engine.ddp_dense = False
    use_config(engine, config)
    if engine.step_count == config.dense_steps:  # else the last dense step of its ramp does this
        end_dense_steps(engine, engine.step_count)
    elif engine.step_count > config.dense_steps:  # sparse steps go on at another density or wire
        engine.masks.begin(for_step=engine.step_count + 1)


def end_dense_steps(engine: ScapeEngine, step: int) -> None:
    """After the last dense step (of the warm-up, or of a form): every coordinate counts as sent at ``step``, and
    the first masks are built."""
    for bs in engine.buckets:
        bs.dense_shard = None
        bs.last_sent.fill_(step)
    engine.masks.begin()


def take_ddp_form(engine: ScapeEngine, fresh: bool = False) -> None:
    """After a dense step: if the pilot takes fp32 dense steps (``engine.ddp_dense``), make every bucket whole on
    every rank (one all-gather of each bucket's momentum, counted as ``"dense"`` traffic) so that the next steps
    run as DDP's. Waits while a bucket's residual still holds gradient that an fp32 dense step must send first
    (the first one after sparse or int8 steps does, sharded). Every rank must call this after the same step.

    Args:
        engine: The engine.
        fresh: At construction: the momentum is zero everywhere, so nothing is gathered.
    """
    buckets = engine.buckets
    cfg = engine.config
    wanted = engine.ddp_dense and cfg.wire_format == "full" and cfg.dense_steps > engine.step_count
    if not wanted or engine.world_size == 1 or not all(bs.sharded for bs in buckets):
        return
    if any(bs.residual_live for bs in buckets):
        return
    whole = [torch.zeros(bs.layout.padded_numel, dtype=bs.momentum.dtype, device=bs.momentum.device) for bs in buckets]
    if not fresh:
        gathers = [engine.wire.all_gather("dense", w, bs.momentum) for bs, w in zip(buckets, whole, strict=True)]
        for pending in gathers:
            engine.wire.wait(pending)
    for bs, w in zip(buckets, whole, strict=True):
        bs.replicate(w)


def shard_again(engine: ScapeEngine) -> None:
    """Leave DDP's dense form: every bucket keeps its shard of the momentum (no collective)."""
    for bs in engine.buckets:
        bs.unreplicate()
