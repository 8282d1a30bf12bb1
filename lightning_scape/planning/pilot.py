"""The form pilot: SCAPE chooses its form from the link it measures, and keeps choosing during the run.

Where ``ScapeConfig`` leaves ``wire_format`` and ``density`` unset, the engine starts with fp32 dense steps (what
DDP + AdamS sends) and this pilot, after every step:

1. measures the step's compute: its wall-clock less the time blocked on SCAPE's collectives;
2. at a decision (the end of the dense warm-up or step 10, whichever comes first, and not before step 5:
   :func:`~lightning_scape.config.first_decision_step`; then every :data:`RECHECK_STEPS` steps, during a density
   ramp too), measures the link with timed all-gathers of
   two sizes
   (:func:`~lightning_scape.planning.forms.link_from_probe`) and all-reduces both measurements, so that every
   rank holds the same numbers;
3. predicts every form's time to the same loss (:func:`~lightning_scape.planning.forms.predict`) and takes the
   fastest if it beats the form in use by :data:`~lightning_scape.planning.forms.SWITCH_MARGIN`
   (:func:`~lightning_scape.planning.forms.choose`);
4. switches the engine (:func:`~lightning_scape.engine.form_switch.switch_form`) and reports the decision.

A form's compute, once measured, is kept: a form that turned out slower than predicted (the int8 wire's rounding,
a sparse step's mask selection) is predicted with its own compute from then on. The steps of a density ramp are
not a sparse form's steps (its first ones are dense): they are left out of its compute, but a decision during the
ramp still measures the link, so a link that changes then is seen within :data:`RECHECK_STEPS` steps.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_scape.config import ScapeConfig, first_decision_step
from lightning_scape.engine.form_switch import switch_form
from lightning_scape.planning import forms
from lightning_scape.planning.forms import FP32_DENSE, Form, Prediction
from lightning_scape.planning.network import Cluster, Link

if TYPE_CHECKING:
    from lightning_scape.engine.scape_engine import ScapeEngine

log = logging.getLogger(__name__)

# Steps between decisions. On a slow link a decision sends the probe's all-gathers, 2.6 MB per rank at W = 2: about
# what 1% of a 100M-parameter model's gradient takes on the int8 wire.
RECHECK_STEPS = 200
# The probe: all-gathers of this many fp32 elements per rank, each timed PROBE_REPEATS times, the fastest kept (a
# probe can only be slowed by noise, never sped up). The bandwidth is read from their difference, so both are
# larger than what a switch or a shaper lets through at once (its burst): that part cancels.
PROBE_SMALL_NUMEL = 1 << 16
PROBE_LARGE_NUMEL = 1 << 18
PROBE_REPEATS = 2
# On a fast link the large probe grows 4x at a time until it takes PROBE_MIN_S (a millisecond of scheduling noise
# would otherwise read as a slower link: 1 MB takes 0.8 ms at 10 Gbit/s), its gathered output at most
# PROBE_MAX_OUTPUT elements (128 MB of fp32).
PROBE_MIN_S = 0.02
PROBE_MAX_OUTPUT = 1 << 25
# The first steps of a form are left out of its compute: they compile kernels and fill buffers.
SETTLING_STEPS = 2
# Between decisions, every WATCH_STEPS steps the ranks all-reduce their median step of the last WATCH_STEPS (16 bytes);
# one that moved by more than WATCH_CHANGE from the median of the steps before the last decision (where it kept the
# form; after a switch, the first watch's) (a link that slowed or sped up, another job on the machine) brings the
# next decision forward to this step.
WATCH_STEPS = 20
WATCH_CHANGE = 1.25


@dataclass(frozen=True)
class Decision:
    """One decision: what was measured, what each form was predicted to take, what was chosen.

    Attributes:
        step: The step after which it was taken.
        link: The measured link (all ranks' mean).
        compute_s: The compute of the form in use (all ranks' mean of the per-rank medians); None where none of its
            steps since the previous decision was measured (all in its density ramp).
        predictions: Every candidate's prediction.
        before: The form in use until then.
        chosen: The form from the next step on.
    """

    step: int
    link: Link
    compute_s: float | None
    predictions: tuple[Prediction, ...]
    before: Form
    chosen: Form

    def describe(self) -> str:
        """The log line: measured, chosen, each candidate's predicted step and time to the same loss, why."""
        rate = f"{self.link.bandwidth_bps / 1e9:.3g} Gbit/s, {1e6 * self.link.latency_s:.0f} us latency"
        cands = "; ".join(
            f"{p.form.name} {1e3 * p.step_s:.1f} ms x {p.steps_factor:g} steps = {1e3 * p.time_to_loss:.1f}"
            + (" (measured)" if p.step_measured else "" if p.compute_measured else " (compute of the dense steps)")
            for p in sorted(self.predictions, key=lambda p: p.time_to_loss)
        )
        if self.chosen == self.before:
            verdict = f"keeps {self.chosen.name}: no form is predicted {forms.SWITCH_MARGIN:g}x faster to the same loss"
        else:
            verdict = f"switches from {self.before.name} to {self.chosen.name}, the fastest to the same loss"
        compute = "not measured (density ramp)" if self.compute_s is None else f"{1e3 * self.compute_s:.1f} ms a step"
        return (
            f"SCAPE after step {self.step} {verdict}. Measured: link {rate}; compute {compute}. Predicted ms per "
            f"step x steps to the same loss (against dense AdamS) = ms per step of progress: "
            f"{cands}. Fix the form with ScapeStrategy({self.chosen.settings()})."
        )


class FormPilot:
    """Chooses SCAPE's form from the measured link (``docs/self_driving.md``).

    Args:
        on_decision: Called on every rank with each decision (the strategies log it on rank 0); default: logged
            by this module's logger on rank 0.
        agree: Where other engines must take the same decisions (``ScapeFSDPStrategy``: the engines of the other
            shards, each over its own ranks), a collective that returns a float64 tensor's mean over those engines,
            called in the same order on every rank. Every measurement passes through it, so engines of the same
            layout (FSDP pads every shard to the same size) decide alike, at the same steps. None: this engine's
            ranks decide alone.
    """

    def __init__(
        self, on_decision: Callable[[Decision], None] | None = None, agree: Callable[[Tensor], Tensor] | None = None
    ) -> None:
        self.agree = agree
        self.form: Form = FP32_DENSE
        self.compute_s: dict[Form, float] = {}
        self.decisions: list[Decision] = []  # this process's, with their predictions
        self.switches: list[tuple[int, Form]] = []  # the run's (kept in checkpoints): after which step, to which form
        self.on_decision = on_decision
        self.last_decision_step: int | None = None
        self._samples: list[float] = []  # per step: its compute (wall-clock less the wait on SCAPE's collectives)
        self._step_samples: list[float] = []  # per step: its wall-clock
        self._last: tuple[float, float] | None = None  # (clock, total wait) after the previous step
        self._watched: float | None = None  # the watch's reference step (the last decision's, or the first watch)

    # ------------------------------------------------------------------ the engine's hook

    def after_step(self, engine: ScapeEngine) -> None:
        """Measure the step; at a decision point, decide (every rank alike)."""
        now, waited = time.perf_counter(), engine.counters.total_wait_s
        if self._last is not None and not self.in_ramp(engine):
            self._step_samples.append(now - self._last[0])
            self._samples.append(self._step_samples[-1] - (waited - self._last[1]))
        self._last = (now, waited)
        if engine.step_count < self.next_decision(engine) and not self._step_changed(engine):
            return
        self.decide(engine)
        self._last = (time.perf_counter(), engine.counters.total_wait_s)  # the probe is not a step's compute

    def step_begins(self, engine: ScapeEngine) -> None:
        """Mark the start of a step's forward pass, so that what ran since the previous step (validation,
        checkpoints, other work) does not count as this form's compute; without it a step's compute runs from
        the end of the previous one."""
        self._last = (time.perf_counter(), engine.counters.total_wait_s)

    def next_decision(self, engine: ScapeEngine) -> int:
        """The step after which the next decision is taken."""
        if self.last_decision_step is None:
            return first_decision_step(engine.requested_config.dense_warmup_steps)
        return self.last_decision_step + RECHECK_STEPS

    def _step_changed(self, engine: ScapeEngine) -> bool:
        """At a watch (every :data:`WATCH_STEPS` steps between decisions, outside a density ramp): whether the
        ranks' median step moved by more than :data:`WATCH_CHANGE` since the last decision (the steps before it, where
        it kept the form in use; else the first watch after it)."""
        due = self.last_decision_step is not None and engine.step_count % WATCH_STEPS == 0
        if not due or self.in_ramp(engine) or engine.step_count - (self.last_decision_step or 0) < WATCH_STEPS:
            return False
        recent = self._recent_step(engine)
        total, share = self._mean(engine, [recent or 0.0, 1.0 if recent else 0.0])
        if share == 0:
            return False
        step = total / share  # the mean over the ranks that measured steps
        if self._watched is None:
            self._watched = step
            return False
        return not 1 / WATCH_CHANGE <= step / self._watched <= WATCH_CHANGE

    def _recent_step(self, engine: ScapeEngine) -> float | None:
        """This rank's median step over the last :data:`WATCH_STEPS` measured steps (None: none measured)."""
        recent = self._step_samples[-WATCH_STEPS:]
        return statistics.median(recent) if recent else None

    def in_ramp(self, engine: ScapeEngine) -> bool:
        """Whether the step just taken belongs to the density ramp of the sparse form in use."""
        cfg = engine.config
        return not self.form.dense and engine.step_count <= cfg.dense_warmup_steps + cfg.density_ramp_steps

    def decide(self, engine: ScapeEngine) -> Decision:
        """Measure the link, predict every form, and switch the engine if one is clearly faster."""
        compute, step, recent, link = self._measure(engine)
        if compute is not None:
            self.compute_s[self.form] = compute
            self.compute_s.setdefault(FP32_DENSE, compute)
        base = engine.requested_config
        candidates = forms.candidates(base.sharded)
        layout = [bs.layout for bs in engine.buckets]
        cluster = Cluster(engine.world_size, 1, link)
        predictions = forms.predict(candidates, layout, base, cluster, self.compute_s)
        # A dense form in use: its measured step, not the model's (an overlap the model cannot see). A sparse one keeps
        # the model with its measured compute, as its alternatives have: its measured step would carry work they lack.
        if step is not None and self.form.dense:
            predictions = [dataclasses.replace(p, step_s=step, step_measured=True) if p.form == self.form else p
                           for p in predictions]  # fmt: skip
        chosen = forms.choose(predictions, self.form)
        if not base.sharded and not self.form.dense:
            chosen = self.form  # a replicated engine cannot turn dense after sparse steps (form_switch)
        decision = Decision(engine.step_count, link, compute, tuple(predictions), self.form, chosen)
        self.decisions.append(decision)
        self.last_decision_step = engine.step_count
        # The watch's reference, where the form is kept: the steps before this decision, so that a link that changes
        # just after it is seen at the first watch, not taken for the reference.
        self._watched = recent if chosen == self.form else None
        if chosen != self.form:
            self._switch(engine, chosen)
        engine.ddp_dense = self.form == FP32_DENSE
        self._report(engine, decision)
        return decision

    def _switch(self, engine: ScapeEngine, chosen: Form) -> None:
        """Take ``chosen`` from the next step on; after a dense stretch, a sparse form's ramp skips the dense steps
        the run has just had, and after sparse steps it continues their density
        (:meth:`~lightning_scape.planning.forms.Form.config`)."""
        base = engine.requested_config
        before = None if self.form.dense else engine.config
        switch_form(engine, chosen.config(base, engine.step_count, self._dense_since(base), before))
        self.form = chosen
        self.switches.append((engine.step_count, chosen))

    def _dense_since(self, base: ScapeConfig) -> int | None:
        """The step after which every step was dense (the warm-up's end at the earliest); None: the form in use is
        sparse."""
        last_switch = self.switches[-1][0] if self.switches else 0
        return max(last_switch, base.dense_warmup_steps) if self.form.dense else None

    # ------------------------------------------------------------------ measurements

    def _measure(self, engine: ScapeEngine) -> tuple[float | None, float | None, float | None, Link]:
        """This form's compute and step (None: no step of it measured since the last decision; alike on every
        rank), the median of its last :data:`WATCH_STEPS` steps (the watch's reference if the form is kept) and the
        link, each the mean over the ranks (so every rank decides alike)."""
        measured = bool(self._samples)
        compute = self._compute(self._samples) if measured else 0.0
        step = self._step_time(self._step_samples) if measured else None
        recent = self._recent_step(engine)
        self._samples, self._step_samples = [], []  # the next decision measures the steps after this one
        small, large_numel, large = self._probe_times(engine)
        compute, step_s, recent_sum, recent_ranks, small, large = self._mean(
            engine, [compute, math.nan if step is None else step, recent or 0.0, 1.0 if recent else 0.0, small, large]
        )
        link = forms.link_from_probe(PROBE_SMALL_NUMEL, small, large_numel, large, engine.world_size)
        step_or_none = None if math.isnan(step_s) else step_s
        return (
            (compute if measured else None),
            step_or_none,
            (recent_sum / recent_ranks if recent_ranks else None),
            link,
        )

    def _step_time(self, samples: list[float]) -> float | None:
        """One step's wall-clock in the form in use: the median of its last :data:`WATCH_STEPS` steps, its first
        steps left out (a link that fell since the last decision is judged by the steps it slowed, not by a median
        of the 200 that came before); None: predict it."""
        return statistics.median(samples[SETTLING_STEPS:][-WATCH_STEPS:] or samples)

    def _compute(self, samples: list[float]) -> float:
        """One step's compute from the form's steps so far: the median, its first steps left out."""
        return statistics.median(samples[SETTLING_STEPS:] or samples)

    def _probe_times(self, engine: ScapeEngine) -> tuple[float, int, float]:
        """The seconds of the small probe, and the size and seconds of the large one (each the fastest of its
        repeats): grown until every rank's mean time reaches :data:`PROBE_MIN_S` (so all ranks grow it alike)."""
        small = timed_gather(engine, PROBE_SMALL_NUMEL)
        numel, most = PROBE_LARGE_NUMEL, max(PROBE_LARGE_NUMEL, PROBE_MAX_OUTPUT // engine.world_size)
        large = timed_gather(engine, numel)
        while numel * 4 <= most and self._mean(engine, [large])[0] < PROBE_MIN_S:
            numel *= 4
            large = timed_gather(engine, numel)
        return small, numel, large

    def _mean(self, engine: ScapeEngine, values: list[float]) -> list[float]:
        """The mean of each value over the ranks, and over the engines that must agree."""
        return _mean_over_ranks(engine, values, self.agree)

    def _report(self, engine: ScapeEngine, decision: Decision) -> None:
        if self.on_decision is not None:
            self.on_decision(decision)
        elif engine.rank == 0:
            log.info(decision.describe())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The form in use, the measured compute of each form, the step of the last decision and the switches."""
        return {
            "form": _form_dict(self.form),
            "compute_s": [[_form_dict(f), s] for f, s in self.compute_s.items()],
            "last_decision_step": self.last_decision_step,
            "switches": [[step, _form_dict(f)] for step, f in self.switches],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the engine restores the form's configuration itself)."""
        self.form = Form(**state["form"])
        self.compute_s = {Form(**f): float(s) for f, s in state["compute_s"]}
        self.last_decision_step = state["last_decision_step"]
        self.switches = [(int(step), Form(**f)) for step, f in state.get("switches", [])]
        self._samples, self._step_samples, self._last, self._watched = [], [], None, None


def _form_dict(form: Form) -> dict[str, Any]:
    return {"wire_format": form.wire_format, "density": form.density}


def _device(engine: ScapeEngine) -> torch.device:
    """Where the engine's buckets live (the collectives' tensors must be there: NCCL takes CUDA tensors only)."""
    return engine.buckets[0].params.device if engine.buckets else torch.device("cpu")


def _mean_over_ranks(
    engine: ScapeEngine, values: list[float], agree: Callable[[Tensor], Tensor] | None = None
) -> list[float]:
    """Every rank's mean of each value (one all-reduce, counted as ``"probe"`` traffic), then the mean over the
    engines that ``agree`` joins (:class:`FormPilot`)."""
    local = torch.tensor(values, dtype=torch.float64, device=_device(engine))
    engine.wire.wait(engine.wire.all_reduce_sum("probe", local))
    local /= engine.world_size
    if agree is not None:
        local = agree(local)
    return [float(x) for x in local.cpu()]


def timed_gather(engine: ScapeEngine, numel: int) -> float:
    """The fastest of :data:`PROBE_REPEATS` timed all-gathers of ``numel`` fp32 elements per rank (counted as
    ``"probe"`` traffic)."""
    device = _device(engine)
    send = torch.ones(numel, dtype=torch.float32, device=device)
    out = torch.empty(numel * engine.world_size, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        engine.wire.wait(engine.wire.all_gather("probe", out, send))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
