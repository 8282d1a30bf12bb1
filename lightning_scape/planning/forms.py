"""The forms SCAPE can take, each one's predicted time to the same loss on a measured link, and the choice.

A form is how every step of a stretch of the run is sent: every step dense (fp32, as DDP sends it, or on the
int8 wire), or sparse steps at a density after a density ramp. Its time to a given loss is its step time times
the steps it needs to reach that loss, as a multiple of dense AdamS's (:data:`STEPS_TO_LOSS`, measured in the
time-to-loss benchmark: ``docs/benchmarks.md``). The step time is the planning model's
(:func:`~lightning_scape.planning.predict.step_time`) for the form's collectives on the engine's own layout,
with the compute measured in the run and the link measured by timed all-gathers (:func:`link_from_probe`).
The form pilot (:mod:`~lightning_scape.planning.pilot`) measures and switches; ``lightning-scape estimate``
predicts the same choice offline. ``docs/self_driving.md`` has the rule and its measurements.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_scape.comm.wire import all_gather_bytes
from lightning_scape.config import AUTO_START_DENSITY, DENSE_FOREVER, ScapeConfig, WireFormat
from lightning_scape.engine.layout import Bucket
from lightning_scape.planning.network import Cluster, Link
from lightning_scape.planning.predict import HIGHEST_BPS, StepCompute, mean_step, step_time
from lightning_scape.planning.traffic import ScapeTraffic

# A form replaces the one in use only when it is predicted to reach the same loss this much sooner, so that
# measurement noise does not make the run flap between two forms of about the same speed.
SWITCH_MARGIN = 1.1


@dataclass(frozen=True)
class Form:
    """One way to send the steps of a stretch of the run.

    Attributes:
        wire_format: ``"full"`` (the parameters' dtype) or ``"int8"``.
        density: The sparse steps' density; None: every step dense.
    """

    wire_format: WireFormat
    density: float | None = None

    @property
    def dense(self) -> bool:
        """Whether every step is dense."""
        return self.density is None

    @property
    def name(self) -> str:
        """How the logs and the estimate name it: ``"fp32 dense"``, ``"int8 dense"``, ``"int8 d=0.025"``."""
        wire = "fp32" if self.wire_format == "full" else self.wire_format
        return f"{wire} dense" if self.density is None else f"{wire} d={self.density:g}"

    def settings(self) -> str:
        """The settings that fix this form, to paste into ``ScapeStrategy(...)``."""
        if self.density is None:
            return f'wire_format="{self.wire_format}", dense_warmup_steps=10**9'
        return f'wire_format="{self.wire_format}", density={self.density:g}'

    def config(
        self, base: ScapeConfig, step: int, dense_since: int | None = None, sparse_before: ScapeConfig | None = None
    ) -> ScapeConfig:
        """The engine's configuration for this form from after step ``step`` on, with the schedule and options of
        ``base`` (the run's, as requested): every later step dense, or a density ramp that starts after step ``step``,
        or after ``base``'s warm-up where that ends later (the first decision may come first: the warm-up goes on,
        dense on this form's wire).

        ``dense_since``: every step after this one (and the warm-up) was dense (None: not so). A sparse form then
        skips its ramp's dense steps where the run has taken at least as many since, and starts where its ramp turns
        sparse: the run has had the dense steps a fixed form's schedule gives before its first sparse step, and its
        momentum is warm. The first decision, right after the warm-up, keeps the whole ramp.

        ``sparse_before``: the sparse form in use until now (None: a dense one). This one's ramp then continues the
        density where that one's schedule is: it is placed where its own geometric ramp reaches that density
        (going sparser: 0.025 to 0.01 in the last fifth of a ramp's length), or where it does not reach so far,
        keeps that form's timing; masks and momentum are warm, so nothing starts again.
        """
        if self.density is None:
            return base.replace(
                wire_format=self.wire_format, density=AUTO_START_DENSITY, dense_warmup_steps=DENSE_FOREVER
            )
        # The first decision may come before the warm-up's end: the warm-up goes on, dense on this form's wire.
        sparse = base.replace(
            wire_format=self.wire_format, density=self.density, dense_warmup_steps=max(step, base.dense_warmup_steps)
        )
        if sparse_before is not None:
            return sparse.replace(dense_warmup_steps=_continuing_ramp(sparse, sparse_before, step))
        ramp_began = step - (sparse.dense_steps - step)  # as if the ramp's dense steps were the ones just taken
        if dense_since is not None and ramp_began >= dense_since:
            return sparse.replace(dense_warmup_steps=ramp_began)
        return sparse


def _continuing_ramp(sparse: ScapeConfig, before: ScapeConfig, step: int) -> int:
    """The warm-up length that places ``sparse``'s ramp where its density after step ``step`` is ``before``'s at
    ``step`` (d ** (s / R) = that density), or, where that would begin before the run did, ``before``'s own."""
    density, target = before.ramp_density(step), sparse.sparse_density
    if density >= 1.0 or sparse.density_ramp_steps == 0:
        return before.dense_warmup_steps
    ramp_step = sparse.density_ramp_steps * math.log(density) / math.log(target)
    return max(step - round(ramp_step), before.dense_warmup_steps)


FP32_DENSE = Form("full")
INT8_DENSE = Form("int8")

# Steps to the same loss as a multiple of dense AdamS's (DDP + AdamS), from the time-to-loss benchmark (W = 2,
# the 0.86M-parameter GPT, L* = DDP + AdamW's loss after 800 steps; docs/benchmarks.md, "Time to L* with the
# int8 wire" and "Every step dense on the int8 wire"): DDP + AdamS 604 and 647 steps (seeds 0, 1); every step
# dense on the int8 wire 587 and 654; the int8 wire at d = 0.025 802 and 865, at d = 0.01 860; fp32 at d = 0.01
# 823 and 927.
STEPS_TO_LOSS: Mapping[Form, float] = {
    FP32_DENSE: 1.0,
    INT8_DENSE: 1.0,
    Form("int8", 0.025): 1.33,
    Form("int8", 0.01): 1.42,
    Form("full", 0.01): 1.4,
}


def candidates(sharded: bool) -> list[Form]:
    """The forms SCAPE chooses from: with ``sharded=False`` only the fp32 ones (the int8 wire needs shards)."""
    return [f for f in STEPS_TO_LOSS if sharded or f.wire_format == "full"]


@dataclass(frozen=True)
class Prediction:
    """One form's predicted step and time to the same loss.

    Attributes:
        form: The form.
        step_s: Its step, seconds.
        steps_factor: Its steps to the same loss, as a multiple of dense AdamS's.
        compute_measured: Whether its compute was measured in this run (else the dense steps' is taken).
        step_measured: Whether its step is the one measured in the run (the form in use) rather than predicted.
    """

    form: Form
    step_s: float
    steps_factor: float
    compute_measured: bool
    step_measured: bool = False

    @property
    def time_to_loss(self) -> float:
        """Seconds per step of dense AdamS's progress: what the choice compares."""
        return self.step_s * self.steps_factor


def link_from_probe(
    small_numel: int, small_s: float, large_numel: int, large_s: float, world_size: int, itemsize: int = 4
) -> Link:
    """The link that explains two timed all-gathers of ``small_numel`` and ``large_numel`` elements per rank.

    The bandwidth is the extra bytes of the large one over its extra time; the latency what is left of the small
    one's time, per step of the ring. A large gather no slower than the small one reads as the fastest link the
    model knows (10 Tbit/s).
    """
    small_b = all_gather_bytes(small_numel, itemsize, world_size)
    large_b = all_gather_bytes(large_numel, itemsize, world_size)
    extra_s = large_s - small_s
    bps = min(HIGHEST_BPS, 8 * (large_b - small_b) / extra_s) if extra_s > 0 else HIGHEST_BPS
    latency = max(0.0, small_s - 8 * small_b / bps) / max(1, world_size - 1)
    return Link(bps, latency, efficiency=1.0)


def predict(
    forms: Sequence[Form],
    layout: Sequence[Bucket],
    base: ScapeConfig,
    cluster: Cluster,
    compute_s: Mapping[Form, float],
    start: Form = FP32_DENSE,
) -> list[Prediction]:
    """Each form's step on ``cluster`` and time to the same loss, with the compute each form was measured at.

    Args:
        forms: The candidates.
        layout: The engine's buckets.
        base: The run's configuration (its schedule, chunk size, sharding, mask options).
        cluster: The ranks and the link (the engine measures one rank per node: ``Cluster(W, 1, link)``).
        compute_s: Per form measured so far, one step's seconds without waiting on SCAPE's collectives; must hold
            ``start``, whose compute stands in for a form not measured yet.
        start: The form measured first.
    """
    out = []
    for form in forms:
        cfg = form.config(base, base.dense_warmup_steps)  # a sparse form: the ramp after the warm-up
        if form == FP32_DENSE:
            cfg = cfg.replace(sharded=False)  # the engine takes the chosen fp32 dense steps in DDP's form
        compute = StepCompute.from_total(max(compute_s.get(form, compute_s[start]), 1e-9))
        traffic = ScapeTraffic(layout, cfg)
        if form.dense:
            step = step_time(next(iter(traffic.steps(1))), compute, cluster).total_s
        else:
            step = mean_step(traffic.steady_state(), compute, cluster, 0.0, overlap_next=True).total_s
        out.append(Prediction(form, step, STEPS_TO_LOSS.get(form, math.inf), form in compute_s))
    return out


def choose(predictions: Sequence[Prediction], current: Form) -> Form:
    """The form with the shortest time to the same loss, if it beats ``current``'s by :data:`SWITCH_MARGIN`."""
    best = min(predictions, key=lambda p: p.time_to_loss)
    now = next((p for p in predictions if p.form == current), None)
    if now is None or best.time_to_loss * SWITCH_MARGIN < now.time_to_loss:
        return best.form
    return current
