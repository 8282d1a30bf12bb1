"""A rank's SCAPE state in a checkpoint: what is saved, what must match to load it, loading it, re-sharding it.

The state holds this rank's momentum region, residual, last-sent steps, queued and last-built masks, the
step and refresh counters and the byte counters; the parameters are the model's and are saved with it.
Every rank saves and loads its own. Loading checks everything first and changes nothing on a mismatch.

Each saved bucket names its parameters (their numbers in the optimizer's param groups, as a torch optimizer's
state dict numbers them) and its chunk size. A bucket whose parameters have not joined the engine when the state
loads (frozen again: Lightning's ``BaseFinetuning`` does that when a fit resumes) waits for them
(:mod:`~lightning_scape.engine.waiting`), and is saved again with the next state.

A state saved by W ranks loads on W' != W ranks once :class:`StateResharder` has built each new rank's state
from the W old ones (read one at a time): the momentum and last-sent steps of the new region copied from the
old shards that overlap it, the residuals redistributed so that the global unsent gradient (the mean over
ranks of the residuals) is unchanged while every coordinate's new owner keeps the residual its old owner
scored it with, the byte counters of old rank ``min(rank, W - 1)``, and no masks: loading such a state
rebuilds them from the restored statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_scape.adams import state_dtype_for
from lightning_scape.config import FIXED_FORM_DENSITY, REMOVED_OPTIONS, ScapeConfig
from lightning_scape.engine import form_switch, joining
from lightning_scape.engine.layout import Bucket, ParamPlace
from lightning_scape.engine.waiting import WaitingBucket

if TYPE_CHECKING:
    from lightning_scape.engine import ScapeEngine
    from lightning_scape.engine.buckets import BucketState

# Version 2: masks are saved as their indices alone, and the byte counters without received bytes.
STATE_VERSION = 2
# Fields that decide how the state is laid out: not even ``resume_with_new_config`` changes them.
_LAYOUT_FIELDS = ("chunk_size", "sharded", "bucket_cap_mb")
# In a re-sharded state: the world size that saved it. Its masks are empty and rebuilt when it is loaded.
RESHARDED_FROM = "resharded_from"


def engine_state(engine: ScapeEngine) -> dict[str, Any]:
    """This rank's SCAPE state (waits for masks still being gathered); buckets that wait for their parameters
    (:class:`~lightning_scape.engine.waiting.WaitingBucket`) come after the engine's own."""
    engine.masks.wait_all()
    masks = engine.masks
    numbers = param_numbers(engine)
    step, cfg = engine.step_count, engine.config
    state = _outline(
        engine,
        step_count=step,
        refresh_count=masks.refresh_count,
        peak_lr=list(engine.peak_lr),
        counters=engine.counters.state_dict(),
        buckets=[
            _bucket_state(
                bs.home(bs.momentum).clone(),
                bs.residual.clone(),
                bs.last_sent.clone(),
                masks=[m.indices.clone() for m in masks.queues[i]],
                last_built=None if (lb := masks.last_built[i]) is None else lb.indices.clone(),
                first_step=bs.first_step,
                params=bucket_params(numbers, bs.layout),
                chunk_size=bs.layout.chunk_size,
            )
            for i, bs in enumerate(engine.buckets)
        ]
        + [
            {
                **w.state(step, cfg.dense_steps, engine.rank, cfg.sharded),
                "params": bucket_params(numbers, w.layout),
                "chunk_size": w.layout.chunk_size,
            }
            for w in engine.waiting
        ],
    )
    state["layout"] += [_triple(w.layout) for w in engine.waiting]
    return state


def param_numbers(engine: ScapeEngine) -> dict[int, int]:
    """Each parameter of the optimizer's param groups (by id) numbered as a torch optimizer's state dict numbers
    it: in the order of the groups, a parameter listed twice keeps its first number."""
    numbers: dict[int, int] = {}
    for n, p in enumerate(p for g in engine.optimizer.param_groups for p in g["params"]):
        numbers.setdefault(id(p), n)
    return numbers


def bucket_params(numbers: Mapping[int, int], layout: Bucket) -> list[int]:
    """The numbers (:func:`param_numbers`) of a bucket's parameters in its order; -1: no longer in a param group."""
    return [numbers.get(id(place.param), -1) for place in layout.places]


def _outline(
    engine: ScapeEngine,
    *,
    step_count: int,
    refresh_count: int,
    peak_lr: list[float],
    counters: dict[str, Any],
    buckets: list[dict[str, Any]],
    form: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The outline of a state for ``engine``, saved or re-sharded: its identity, then the given values.

    Args:
        engine: The engine the state is for: its version, configuration, world size, rank and layout.
        step_count: The optimizer steps taken.
        refresh_count: The mask refreshes done.
        peak_lr: Per param group, the peak learning rate.
        counters: The byte counters' state.
        buckets: Per bucket, :func:`_bucket_state`.
        form: The form in use (``"form"``: its configuration) and, where SCAPE chooses the form, its pilot's state
            (``"pilot"``) and whether its fp32 dense steps are DDP's (``"ddp_dense"``); default: ``engine``'s.

    Returns:
        The state, its keys in the order every saved state has them.
    """
    if form is None:
        form = {"form": engine.config.to_dict()}
        if engine.pilot is not None:
            form = {**form, "pilot": engine.pilot.state_dict(), "ddp_dense": engine.ddp_dense}
    return {
        "version": STATE_VERSION,
        "config": engine.requested_config.to_dict(),
        "world_size": engine.world_size,
        "rank": engine.rank,
        "layout": _layout(engine),
        "step_count": step_count,
        "refresh_count": refresh_count,
        "peak_lr": peak_lr,
        "counters": counters,
        "buckets": buckets,
        **form,
    }


def saved_form(engine: ScapeEngine, state: Mapping[str, Any]) -> ScapeConfig:
    """The form the engine resumes ``state`` in: the one SCAPE had chosen, where it chooses the form in both runs;
    else the engine's own (a fixed form, or the start of a run that now chooses)."""
    if engine.pilot is not None and "pilot" in state:
        return ScapeConfig.from_dict(state["form"])
    return engine.config


def _bucket_state(
    momentum: Tensor,
    residual: Tensor,
    last_sent: Tensor,
    masks: list[Tensor],
    last_built: Tensor | None,
    first_step: int,
    params: list[int],
    chunk_size: int,
) -> dict[str, Any]:
    """One bucket's part of a state: its tensors, its queued and last-built masks' indices, the step it joined at,
    its parameters (:func:`bucket_params`) and its chunk size. A state saved before these were kept holds no
    ``first_step`` (0), and no ``params`` or ``chunk_size`` (its layout must then be the engine's exactly)."""
    return {
        "momentum": momentum,
        "residual": residual,
        "last_sent": last_sent,
        "masks": masks,
        "last_built": last_built,
        "first_step": first_step,
        "params": params,
        "chunk_size": chunk_size,
    }


def check_engine_state(engine: ScapeEngine, state: Any) -> None:
    """Raise ``ValueError`` unless :func:`load_engine_state` can restore ``state`` exactly; changes nothing.

    Checks the format version, world size and rank, the configuration (:func:`check_config`),
    the bucket layout (:func:`_pair_buckets`), and the shape and dtype of every saved tensor.
    """
    _check_version(state)
    if state["world_size"] != engine.world_size or state["rank"] != engine.rank:
        raise ValueError(
            f"SCAPE state was saved by rank {state['rank']} of {state['world_size']}, but this is rank "
            f"{engine.rank} of {engine.world_size}. A state from another world size must be re-sharded first: "
            "pass all the saved ranks' states, in rank order, to engine.reshard_state_dicts() and load its "
            "result (the Lightning strategies do this when they resume from a checkpoint)."
        )
    _check_config(engine, state)
    _check_peak_lr(engine, state)
    _plan_load(engine, state)


@torch.no_grad()
def load_engine_state(engine: ScapeEngine, state: dict[str, Any]) -> None:
    """Restore :func:`engine_state`; refuses (changing nothing) a state that :func:`check_engine_state` rejects.

    A re-sharded state (from :class:`StateResharder`) has no masks: they are rebuilt from the restored momentum
    and residual, which launches the index all-gathers, so every rank must load at the same point. Buckets that
    joined the engine after its construction and are not the state's next ones are laid out again: from the
    state, when their parameters join next (:class:`~lightning_scape.engine.waiting.WaitingBucket`).
    """
    check_engine_state(engine, state)
    form_switch.shard_again(engine)  # the state holds shards; the pilot's next dense step gathers them again
    pairing, waiting = _plan_load(engine, state)
    joining.unbind(engine, pairing.kept)
    form_switch.use_config(engine, saved_form(engine, state))
    masks = engine.masks
    for saved, i in zip(state["buckets"], pairing.engine_of, strict=True):
        if i is None:
            continue
        bs = engine.buckets[i]
        bs.momentum.copy_(saved["momentum"])
        bs.residual.copy_(saved["residual"])
        bs.last_sent.copy_(saved["last_sent"])
        bs.first_step = int(saved.get("first_step", 0))
        bs.residual_live = bool(bs.residual.any())
        masks.keep(i, saved["masks"], saved["last_built"])
    engine.waiting = waiting
    engine.step_count = int(state["step_count"])
    engine.peak_lr = [float(x) for x in state["peak_lr"]]
    masks.refresh_count = int(state["refresh_count"])
    engine.counters.load_state_dict(state["counters"])
    if engine.pilot is not None and "pilot" in state:
        engine.pilot.load_state_dict(state["pilot"])
        engine.ddp_dense = bool(state.get("ddp_dense", False))
    if state.get(RESHARDED_FROM) is not None:
        masks.restart(engine.step_count)


@dataclass(frozen=True)
class _Geometry:
    """What a bucket's saved tensors must fit on this rank."""

    chunks: int
    chunk_size: int
    region: int  # the momentum's and last-sent steps' elements
    padded: int  # the residual's elements
    dtype: torch.dtype  # the momentum's and the residual's

    @classmethod
    def of(cls, layout: Bucket, sharded: bool) -> _Geometry:
        region = layout.shard_numel if sharded else layout.padded_numel
        return cls(layout.chunks, layout.chunk_size, region, layout.padded_numel, state_dtype_for(layout.dtype))


@dataclass(frozen=True)
class _Pairing:
    """How a saved state's buckets meet the engine's (:func:`_pair_buckets`).

    Attributes:
        engine_of: Per saved bucket, the engine's bucket that loads it; None: it waits for its parameters.
        kept: The engine's first ``kept`` buckets pair; those after them joined after its construction and are
            laid out again (:func:`~lightning_scape.engine.joining.unbind`).
    """

    engine_of: list[int | None]
    kept: int


def _plan_load(engine: ScapeEngine, state: dict[str, Any]) -> tuple[_Pairing, list[WaitingBucket]]:
    """Check every saved bucket against what will load it; the pairing, and the buckets that wait.

    A waiting bucket keeps the state of its parameters that no bucket of the engine, nor one saved before it,
    holds (a parameter in two saved buckets: the first is the one it was last laid out in).
    """
    pairing = _pair_buckets(engine, state)
    step, cfg = int(state["step_count"]), saved_form(engine, state)
    claimed = {id(place.param) for bs in engine.buckets[: pairing.kept] for place in bs.layout.places}
    waiting = []
    for j, (saved, i) in enumerate(zip(state["buckets"], pairing.engine_of, strict=True)):
        layout = engine.buckets[i].layout if i is not None else _saved_layout(engine, state, j)
        _check_bucket(cfg, j, saved, _Geometry.of(layout, cfg.sharded), step)
        if i is not None:
            continue
        ids = {id(place.param) for place in layout.places}
        if ids - claimed:
            waiting.append(_waiting_bucket(layout, saved, step, ids - claimed))
        claimed |= ids
    return pairing, waiting


def _pair_buckets(engine: ScapeEngine, state: dict[str, Any]) -> _Pairing:
    """Which engine bucket loads each saved bucket: in order, the same parameters (their numbers in the param
    groups), group, size, padding and chunk size. The buckets of the engine's construction must all pair; a saved
    bucket that pairs with none waits for its parameters. A state saved before buckets named their parameters
    loads only into the same layout."""
    saved = [tuple(x) for x in state["layout"]]
    current = _layout(engine)
    buckets = state["buckets"]
    pairing = None
    if len(saved) == len(buckets) and all(b.get("params") is not None for b in buckets):
        pairing = _pair_in_order(engine, saved, buckets)
    elif len(saved) == len(buckets) and saved == current:
        pairing = _Pairing(list(range(len(saved))), len(saved))
    if pairing is None:
        raise ValueError(
            "SCAPE state has another bucket layout (model, param groups or bucket_cap_mb changed): "
            f"saved {saved}, current {current}. (A saved bucket whose parameters are frozen now waits for them, but "
            "the buckets laid out when the optimizer was set up must be the saved state's first ones.)"
        )
    return pairing


def _pair_in_order(engine: ScapeEngine, saved: list[tuple[Any, ...]], buckets: list[Any]) -> _Pairing | None:
    """:func:`_pair_buckets` for a state whose buckets name their parameters; None: they do not pair."""
    numbers = param_numbers(engine)
    mine = [(_triple(bs.layout), bucket_params(numbers, bs.layout), bs.layout.chunk_size) for bs in engine.buckets]
    engine_of: list[int | None] = []
    i = 0
    for triple, bucket in zip(saved, buckets, strict=True):
        if i < len(mine) and (triple, list(bucket["params"]), bucket.get("chunk_size")) == mine[i]:
            engine_of.append(i)
            i += 1
        else:
            engine_of.append(None)
    return _Pairing(engine_of, i) if i >= engine.fixed_buckets else None


def _saved_layout(engine: ScapeEngine, state: dict[str, Any], j: int) -> Bucket:
    """The geometry of saved bucket ``j``, its places holding the parameters of the optimizer it names."""
    group, numel, padded = (int(x) for x in state["layout"][j])
    numbers, chunk = state["buckets"][j]["params"], state["buckets"][j].get("chunk_size")
    entries = [(gi, p) for gi, g in enumerate(engine.optimizer.param_groups) for p in g["params"]]
    params: list[nn.Parameter] = [
        entries[n][1] for n in numbers if type(n) is int and 0 <= n < len(entries) and entries[n][0] == group
    ]
    if not params or len(params) != len(numbers):
        raise ValueError(
            f"SCAPE state: bucket {j} holds parameters {list(numbers)} of param group {group}, which this optimizer's "
            "param groups do not hold there (the model or its param groups changed)."
        )
    kinds, size, W = {(p.dtype, p.device) for p in params}, sum(p.numel() for p in params), engine.world_size
    fits = type(chunk) is int and 0 < chunk <= engine.config.chunk_size and numel <= padded and not padded % (W * chunk)
    if len(kinds) != 1 or size != numel or not fits:
        raise ValueError(
            f"SCAPE state: bucket {j} ({numel} parameters of param group {group}, padded to {padded} in chunks of "
            f"{chunk!r}) does not fit its parameters here ({size} parameters of {sorted(map(str, kinds))}): the model "
            "changed."
        )
    ((dtype, device),) = kinds
    bucket = Bucket(-1, group, dtype, device, numel=numel, padded_numel=padded, world_size=W, chunk_size=chunk)
    for p in params:
        bucket.places.append(ParamPlace(p, sum(place.numel for place in bucket.places), p.numel()))
    return bucket


def _waiting_bucket(layout: Bucket, saved: dict[str, Any], step: int, left: set[int]) -> WaitingBucket:
    return WaitingBucket(
        layout,
        momentum=saved["momentum"],
        last_sent=saved["last_sent"],
        residual=saved["residual"],
        masks=list(saved["masks"]),
        last_built=saved["last_built"],
        first_step=int(saved.get("first_step", 0)),
        saved_step=step,
        left=left,
    )


def _check_bucket(config: ScapeConfig, j: int, saved: dict[str, Any], geometry: _Geometry, step_count: int) -> None:
    """Raise ``ValueError`` unless saved bucket ``j``'s tensors, first step and masks fit ``geometry``."""
    C = geometry.chunk_size
    k_min, k_max = config.slots_for(C), config.max_slots(C)
    _check_tensor(saved["momentum"], geometry.dtype, geometry.region, f"bucket {j} momentum")
    _check_tensor(saved["residual"], geometry.dtype, geometry.padded, f"bucket {j} residual")
    _check_tensor(saved["last_sent"], torch.int32, geometry.region, f"bucket {j} last_sent")
    first = saved.get("first_step", 0)
    if type(first) is not int or not 0 <= first <= step_count:
        raise ValueError(f"SCAPE state: bucket {j} joined at step {first!r}, not an int in [0, step_count].")
    masks = list(saved["masks"]) + ([] if saved["last_built"] is None else [saved["last_built"]])
    for ix in masks:
        fits = isinstance(ix, Tensor) and ix.dtype == torch.int16 and ix.dim() == 2
        if not fits or ix.shape[0] != geometry.chunks or not k_min <= ix.shape[1] <= k_max:
            raise ValueError(
                f"SCAPE state: bucket {j} has a mask that is not int16 of shape ({geometry.chunks}, k) with "
                f"{k_min} <= k <= {k_max}."
            )


class StateResharder:
    """This rank's state built from the states of ``saved_world_size`` ranks, fed one at a time in rank order.

    A rank never holds more than one old state besides its own new one, so the old states can be read from
    their files one by one. Bucket membership does not depend on the world size; the padding and the shard
    boundaries do (chunks do not: chunk c covers coordinates ``[c C, (c + 1) C)`` of its bucket on any W).
    Per bucket, in the real coordinates ``[0, numel)`` (the padding of either layout has zero gradient,
    momentum and residual):

    - momentum and last-sent steps of this rank's region are copied from the old regions that overlap it
      (sharded: the old shards; replicated: old rank 0's whole bucket, which every old rank holds alike).
      New padding coordinates count as sent at the resume step (during the warm-up: at step 0, like all).
    - residuals: the sparse collective averages the ranks' values, so the unsent gradient that counts is
      ``E = sum_r e_r / W`` per coordinate, and the new residuals must keep ``sum_r' e'_r' / W' = E``. Masks
      are scored by each shard's owner from its own residual, so for every coordinate the new owner (the
      rank whose shard holds it) takes the residual that the coordinate's old owner held, the next rank
      (``owner + 1`` mod W') takes the rest of the mass, ``W' E - e_old_owner``, and the other ranks hold zero
      there. The rebuilt masks then score exactly what the old owners scored, and W' = W gives back states
      that act as the saved ones. On one rank the residual is ``E`` itself. ``E`` is summed in old-rank
      order; all of it is exact when the arithmetic is (fp64 with integer values, W a power of two), and in
      fp32 it is rounded like one more residual update.

    The byte counters continue old rank ``min(rank, saved_world_size - 1)``'s totals (every rank counts the
    same bytes; the wait times are that rank's). The step and refresh counters are every old rank's (they
    must agree). The masks are left out: :func:`load_engine_state` rebuilds them.

    Args:
        engine: The engine that will load the result (the new layout, rank and configuration).
        saved_world_size: The number of ranks that saved the states.
    """

    def __init__(self, engine: ScapeEngine, saved_world_size: int) -> None:
        if not isinstance(saved_world_size, int) or saved_world_size < 1:
            raise ValueError(f"SCAPE state: saved world size {saved_world_size!r} is not a positive integer.")
        form_switch.shard_again(engine)  # the new regions are shards, as the saved ones
        self.engine = engine
        self.saved_world_size = saved_world_size
        self._fed = 0
        self._first: dict[str, Any] | None = None
        self._first_steps: list[int] = [0] * len(engine.buckets)
        self._form: dict[str, Any] = {}  # the saved form and pilot state (first rank's)
        self._counters: dict[str, Any] | None = None
        self._momentum = [torch.zeros_like(bs.momentum, device="cpu") for bs in engine.buckets]
        self._last_sent = [torch.zeros_like(bs.last_sent, device="cpu") for bs in engine.buckets]
        self._residual = [torch.zeros_like(bs.residual, device="cpu") for bs in engine.buckets]
        # Where this rank takes the rest of the mass: the shard of the previous rank (on one rank: everything).
        self._rest = [self._rest_of(bs) for bs in engine.buckets]
        # Over those coordinates: the sum of the old residuals, and the old owners' residuals.
        self._sum = [
            torch.zeros(rest.stop - rest.start, dtype=bs.residual.dtype)
            for rest, bs in zip(self._rest, engine.buckets, strict=True)
        ]
        self._owner = [torch.zeros_like(t) for t in self._sum]

    def _rest_of(self, bs: BucketState) -> slice:
        """The real coordinates of the shard whose residual mass beyond its owner's this rank holds."""
        W, n = self.engine.world_size, bs.layout.numel
        if W == 1:
            return slice(0, n)
        S = bs.layout.shard_numel
        d = (self.engine.rank - 1) % W
        return slice(min(d * S, n), min((d + 1) * S, n))

    def add(self, state: Any) -> None:
        """Take in the next old rank's state (``ValueError`` if it does not fit); only what it copies is kept."""
        rank, W = self._fed, self.saved_world_size
        if rank >= W:
            raise ValueError(f"SCAPE state: got more than the {W} rank states of a run on {W} ranks.")
        self._check(state, rank)
        engine = self.engine
        if self._first is None:
            self._first = {k: state[k] for k in ("step_count", "refresh_count", "peak_lr")}
            self._first_steps = [int(b.get("first_step", 0)) for b in state["buckets"]]
            self._form = {k: state[k] for k in ("form", "pilot", "ddp_dense") if k in state}
            if int(state["step_count"]) >= saved_form(engine, state).dense_steps:
                # Past the warm-up every coordinate has a last-sent step; the new padding gets the resume step.
                for t in self._last_sent:
                    t.fill_(int(state["step_count"]))
        for i, (bs, saved) in enumerate(zip(engine.buckets, state["buckets"], strict=True)):
            n, old_padded = bs.layout.numel, int(state["layout"][i][2])
            old_shard = slice(rank * (old_padded // W), (rank + 1) * (old_padded // W))
            if engine.config.sharded:
                old_region = old_shard
            else:  # every old rank holds the same whole bucket: take old rank 0's
                old_region = slice(0, old_padded) if rank == 0 else slice(0, 0)
            _copy_overlap(saved["momentum"], old_region, self._momentum[i], bs.region, n)
            _copy_overlap(saved["last_sent"], old_region, self._last_sent[i], bs.region, n)
            residual = saved["residual"]
            rest = self._rest[i]
            self._sum[i] += residual[rest].cpu()
            if engine.world_size > 1:
                # The old owner's residual where this rank is the new owner, and where it takes the rest.
                _copy_overlap(residual[old_shard], old_shard, self._residual[i][bs.shard], bs.shard, n)
                _copy_overlap(residual[old_shard], old_shard, self._owner[i], rest, n)
        if rank == min(engine.rank, W - 1):
            self._counters = state["counters"]
        self._fed += 1

    def result(self) -> dict[str, Any]:
        """This rank's state, for :func:`load_engine_state` (after every old rank's state was added)."""
        W = self.saved_world_size
        if self._fed != W or self._first is None or self._counters is None:
            raise ValueError(f"SCAPE state: got {self._fed} rank states of a run on {W} ranks; all {W} are needed.")
        engine = self.engine
        for residual, rest, total, owner in zip(self._residual, self._rest, self._sum, self._owner, strict=True):
            # W' E - e_old_owner, with E = sum / W; on one rank E itself (the owner's share is the whole mass).
            residual[rest] = total * engine.world_size / W - owner
        numbers = param_numbers(engine)
        state = _outline(
            engine,
            step_count=self._first["step_count"],
            refresh_count=self._first["refresh_count"],
            peak_lr=list(self._first["peak_lr"]),
            counters=self._counters,
            buckets=[
                _bucket_state(
                    m, e, s, [], None, first, bucket_params(numbers, bs.layout), chunk_size=bs.layout.chunk_size
                )
                for m, e, s, first, bs in zip(
                    self._momentum, self._residual, self._last_sent, self._first_steps, engine.buckets, strict=True
                )
            ],
            form=self._form if "form" in self._form else None,
        )
        return {**state, RESHARDED_FROM: W}

    def _check(self, state: Any, rank: int) -> None:
        """Everything :meth:`add` relies on: version, origin, configuration, layout, shapes, counters."""
        engine, W = self.engine, self.saved_world_size
        _check_version(state)
        if state["world_size"] != W or state["rank"] != rank:
            raise ValueError(
                f"SCAPE state: expected the state of rank {rank} of {W}, got rank {state['rank']} of "
                f"{state['world_size']}."
            )
        _check_config(engine, state)
        _check_peak_lr(engine, state)
        saved = [tuple(x) for x in state["layout"]]
        mine = [(b.layout.group_index, b.layout.numel) for b in engine.buckets]
        if [x[:2] for x in saved] != mine or len(state["buckets"]) != len(engine.buckets):
            raise ValueError(
                "SCAPE state has another bucket layout (model, param groups or bucket_cap_mb changed): saved "
                f"(param group, parameters) per bucket {[x[:2] for x in saved]}, current {mine}. (A bucket whose "
                "parameters are frozen now, as BaseFinetuning leaves a backbone when a fit resumes, waits for them "
                "only on the number of processes and with the settings that saved it: re-sharding needs every saved "
                "bucket's parameters trainable when the state loads.)"
            )
        for i, ((_, n, padded), saved_bucket) in enumerate(zip(saved, state["buckets"], strict=True)):
            # The padding depends on the chunk size a run chose for the bucket (smaller for tiny models): check
            # only what the copy relies on, W equal shards that hold the real coordinates.
            if padded < n or padded % W != 0:
                raise ValueError(
                    f"SCAPE state: bucket {i} of {n} parameters is padded to {padded}, which no run on {W} ranks "
                    "would do."
                )
            region = padded // W if engine.config.sharded else padded
            bs = engine.buckets[i]
            _check_tensor(saved_bucket["momentum"], bs.momentum.dtype, region, f"bucket {i} momentum")
            _check_tensor(saved_bucket["last_sent"], bs.last_sent.dtype, region, f"bucket {i} last_sent")
            _check_tensor(saved_bucket["residual"], bs.residual.dtype, padded, f"bucket {i} residual")
        if self._first is not None and any(state[k] != v for k, v in self._first.items()):
            raise ValueError(
                f"SCAPE state of rank {rank} is at step {state['step_count']} (refresh {state['refresh_count']}), "
                f"rank 0's at step {self._first['step_count']} (refresh {self._first['refresh_count']}): the rank "
                "states come from different saves."
            )


def reshard_engine_state(engine: ScapeEngine, states: Iterable[Any]) -> dict[str, Any]:
    """This rank's state from all the ranks' states of a run on any world size (consumed one at a time).

    Args:
        engine: The engine that will load the result.
        states: Every saved rank's :func:`engine_state`, in rank order (an iterator may read them lazily).

    Returns:
        A state for :func:`load_engine_state` on ``engine``.
    """
    resharder: StateResharder | None = None
    for saved in states:
        if resharder is None:
            _check_version(saved)
            resharder = StateResharder(engine, saved["world_size"])
        resharder.add(saved)
    if resharder is None:
        raise ValueError("SCAPE state: no rank state was given to re-shard.")
    return resharder.result()


def _check_version(state: Any) -> None:
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        found = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"SCAPE state has format version {found!r}; this lightning_scape reads version {STATE_VERSION}. Resume "
            "with the lightning_scape version that wrote the checkpoint, or start a new run from its model weights."
        )


def _check_config(engine: ScapeEngine, state: dict[str, Any]) -> None:
    check_config(engine.requested_config, state["config"], engine.resume_with_new_config)


def config_changes(config: ScapeConfig, saved: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields in which ``config`` differs from ``saved`` (a ``to_dict``), as ``{field: (saved, current)}``.

    An option of an earlier version (:data:`~lightning_scape.config.REMOVED_OPTIONS`) counts as changed where it was
    saved at another value than the one this version always takes; one that never changed a run is left out.
    """
    mine = _fixed_form_spelled_out(config.to_dict())
    # A field added since the state was saved was at its default then.
    before = _fixed_form_spelled_out({**ScapeConfig().to_dict(), **saved})
    changes = {k: (before[k], v) for k, v in mine.items() if before[k] != v}
    for name, (now, _) in REMOVED_OPTIONS.items():
        if now is not None and name in saved and saved[name] != now:
            changes[name] = (saved[name], now)
    return changes


def _fixed_form_spelled_out(fields: dict[str, Any]) -> dict[str, Any]:
    """A fixed form with its wire format or density left out, as ``ScapeConfig`` reads it (``"full"``, 0.01), so
    that ``density=0.05`` resumes a state saved with ``density=0.05, wire_format="full"`` and the other way round."""
    if fields["density"] is None and fields["wire_format"] is None:
        return fields  # SCAPE chooses the form
    density = fields["density"] if fields["density"] is not None else FIXED_FORM_DENSITY
    return {**fields, "wire_format": fields["wire_format"] or "full", "density": density}


def check_config(config: ScapeConfig, saved: Mapping[str, Any], resume_with_new_config: bool = False) -> None:
    """Raise ``ValueError`` unless a state saved with configuration ``saved`` (a ``to_dict``) resumes under ``config``.

    Every field must match (:func:`config_changes`), or, with ``resume_with_new_config``, all but the layout's
    (``chunk_size``, ``sharded``, ``bucket_cap_mb``); the message lists the fields that differ.
    """
    diff = config_changes(config, saved)
    if not diff:
        return
    if resume_with_new_config:
        fixed = {k: v for k, v in diff.items() if k in _LAYOUT_FIELDS}
        if fixed:
            raise ValueError(
                f"SCAPE state cannot be carried into these settings (field: (saved, current)): {fixed}: they decide "
                "how the state is laid out. Keep the saved values; resume_with_new_config=True carries the state into "
                "any other change."
            )
        return
    raise ValueError(
        f"SCAPE state comes from another configuration (field: (saved, current)): {diff}. Resume with "
        "the configuration the checkpoint was written with, or pass resume_with_new_config=True (to the strategy) to "
        "carry the weights, momentum and residuals into the new one (the masks are rebuilt)."
    )


def _check_peak_lr(engine: ScapeEngine, state: dict[str, Any]) -> None:
    peak = state.get("peak_lr")
    groups = len(engine.optimizer.param_groups)
    if not isinstance(peak, list) or len(peak) != groups or not all(isinstance(x, float) for x in peak):
        raise ValueError(f"SCAPE state: peak_lr must list one float per param group ({groups}), found {peak!r}.")


def _check_tensor(got: Any, dtype: torch.dtype, numel: int, what: str) -> None:
    if not isinstance(got, Tensor) or got.shape != (numel,) or got.dtype != dtype:
        desc = (got.dtype, tuple(got.shape)) if isinstance(got, Tensor) else type(got).__name__
        raise ValueError(f"SCAPE state: {what} is {desc}, expected {(dtype, (numel,))}.")


def _copy_overlap(src: Tensor, src_at: slice, dst: Tensor, dst_at: slice, limit: int) -> None:
    """Copy the coordinates below ``limit`` that ``src`` (holding coordinates ``src_at``) and ``dst`` share."""
    lo, hi = max(src_at.start, dst_at.start), min(src_at.stop, dst_at.stop, limit)
    if lo < hi:
        dst[lo - dst_at.start : hi - dst_at.start] = src[lo - src_at.start : hi - src_at.start].to(dst.device)


def _layout(engine: ScapeEngine) -> list[tuple[int, int, int]]:
    return [_triple(b.layout) for b in engine.buckets]


def _triple(layout: Bucket) -> tuple[int, int, int]:
    """A bucket as the state's ``layout`` lists it: param group, parameters, padded size."""
    return (layout.group_index, layout.numel, layout.padded_numel)
