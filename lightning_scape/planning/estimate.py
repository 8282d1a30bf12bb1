"""Does SCAPE pay on this network? Bytes, step time and memory per rank for DDP, its bf16 hook and SCAPE.

:func:`estimate` puts the pieces together: the collectives of each method
(:mod:`~lightning_scape.planning.traffic`), the network (:mod:`~lightning_scape.planning.network`), the step
model (:mod:`~lightning_scape.planning.predict`) and the memory (:mod:`~lightning_scape.planning.memory`);
``lightning-scape estimate`` prints it (:mod:`~lightning_scape.planning.report`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_scape.config import ScapeConfig
from lightning_scape.planning import forms
from lightning_scape.planning.forms import FP32_DENSE, Form, Prediction
from lightning_scape.planning.memory import Memory, ddp_memory, scape_memory
from lightning_scape.planning.network import Cluster
from lightning_scape.planning.predict import (
    ScheduleCost,
    StepCompute,
    StepTime,
    breakeven_bandwidth,
    mean_step,
    schedule_cost,
    step_time,
)
from lightning_scape.planning.traffic import ScapeTraffic, StepTraffic, ddp_bucket_numels, ddp_traffic, scape_layout

DDP = "DDP + AdamW"
DDP_BF16 = "DDP bf16 hook + AdamW"
SCAPE_INT8_DENSE = "SCAPE int8 dense"
DENSITIES = (0.1, 0.01)
# A method must be this much faster per step to be recommended over the one before it: below it, the
# model's own error (docs/benchmarks.md, "Predicted against measured") decides.
CLEAR_GAIN = 1.1
# Sparse steps at a density whose steps to the same loss are not measured (forms.STEPS_TO_LOSS) must be this much
# faster than SCAPE's int8 dense steps to pay: both step AdamS, but the sparse phase needs more steps to reach the
# same loss (1.3-1.4x in the time-to-loss benchmark, docs/benchmarks.md).
SPARSE_STEPS = 1.3


@dataclass(frozen=True)
class MethodEstimate:
    """One method's predicted step.

    Attributes:
        name: ``"DDP + AdamW"``, ``"DDP bf16 hook + AdamW"``, ``"SCAPE int8 dense"`` (the int8 wire with every
            step dense) or ``"SCAPE d=<density>"``.
        density: SCAPE's density (None for the dense methods).
        bytes_per_step: Bytes one rank sends per step (SCAPE: after its schedule), as the package counts them.
        step: The step time.
        memory: Memory per rank, activations excluded.
        dense_bytes_per_step: SCAPE: bytes of one of its dense steps.
        extra_counted: SCAPE: whether the engine's own work per step is part of ``step``.
        steps_factor: SCAPE: the steps its form needs to the loss dense AdamS reaches, as a multiple of dense
            AdamS's (:data:`~lightning_scape.planning.forms.STEPS_TO_LOSS`); None where not measured.
        breakeven_bps: SCAPE: per dense method, the link rate below which SCAPE reaches the same loss sooner (its
            step times ``steps_factor`` against the dense method's step); per step where ``steps_factor`` is None.
        schedule: SCAPE: what its warm-up and ramp cost against DDP.
        run_s: The whole run's time, when its length was given.
    """

    name: str
    density: float | None
    bytes_per_step: float
    step: StepTime
    memory: Memory
    dense_bytes_per_step: int | None = None
    extra_counted: bool = True
    steps_factor: float | None = None
    breakeven_bps: dict[str, float] | None = None
    schedule: ScheduleCost | None = None
    run_s: float | None = None


@dataclass(frozen=True)
class Estimate:
    """Everything ``lightning-scape estimate`` prints."""

    params: int
    cluster: Cluster
    compute: StepCompute
    config: ScapeConfig
    methods: list[MethodEstimate]
    run_steps: int | None
    recommendation: str
    forms: tuple[Prediction, ...] = ()

    @property
    def chosen_form(self) -> Form | None:
        """The form SCAPE's defaults would take on this cluster (None: the configuration fixes it)."""
        return forms.choose(self.forms, FP32_DENSE) if self.forms else None

    def method(self, name: str) -> MethodEstimate:
        """The method called ``name``."""
        return next(m for m in self.methods if m.name == name)


def scape_name(density: float, wire_format: str | None = None) -> str:
    """``SCAPE d=0.01``; on the int8 wire ``SCAPE int8 d=0.025``."""
    return f"SCAPE int8 d={density:g}" if wire_format == "int8" else f"SCAPE d={density:g}"


def estimate(
    param_groups: list[dict[str, Any]],
    cluster: Cluster,
    compute: StepCompute,
    densities: Sequence[float] = DENSITIES,
    config: ScapeConfig | None = None,
    run_steps: int | None = None,
    overlap_next: bool = True,
) -> Estimate:
    """Predict DDP, DDP with the bf16 hook, and SCAPE at each density on ``cluster``; with the int8 wire (sharded),
    also SCAPE with every step dense.

    Args:
        param_groups: The trainable parameters (:func:`~lightning_scape.planning.traffic.parameter_groups`).
        cluster: The network.
        compute: One rank's compute per step.
        densities: SCAPE's densities.
        config: SCAPE's other settings (default: the package's); its density is replaced by each of ``densities``.
        run_steps: The run's length, for its total time (None: not asked).
        overlap_next: Whether SCAPE's index all-gathers overlap the next forward pass (the engine's schedule);
            False charges them to the step, as the network benchmark does.
    """
    base = config or ScapeConfig()
    if run_steps is not None and run_steps < 1:
        raise ValueError(f"run_steps must be >= 1, got {run_steps}.")
    buckets = ddp_bucket_numels(param_groups, base.bucket_cap_mb)
    dense = {DDP: ddp_traffic(buckets), DDP_BF16: ddp_traffic(buckets, itemsize=2)}
    W = cluster.world_size
    methods = []
    for name, traffic in dense.items():
        step = step_time(traffic, compute, cluster)
        run_s = None if run_steps is None else run_steps * step.total_s
        methods.append(MethodEstimate(name, None, traffic.bytes_sent(W), step, ddp_memory(param_groups), run_s=run_s))
    if base.wire_format == "int8" and base.sharded:
        methods.append(_scape_int8_dense(param_groups, cluster, compute, base, run_steps))
    for d in densities:
        cfg = base.replace(density=d)
        methods.append(_scape(param_groups, cluster, compute, cfg, dense, run_steps, overlap_next))
    params = sum(p.numel() for g in param_groups for p in g["params"])
    if not base.chooses_form:
        return Estimate(params, cluster, compute, base, methods, run_steps, recommend(methods, run_steps))
    # What the run's form pilot would predict and choose, from the same model (docs/self_driving.md).
    layout = scape_layout(param_groups, W, base.start_form())
    candidates = forms.candidates(base.sharded)
    predicted = tuple(forms.predict(candidates, layout, base, cluster, {FP32_DENSE: compute.total_s}))
    chosen = forms.choose(predicted, FP32_DENSE)
    text = (
        f"SCAPE's defaults would run {chosen.name} on this cluster, the form predicted to reach the same loss first "
        f"(the table above: ms per step x steps to the loss dense AdamS reaches); the run measures the link and the "
        f"compute itself and decides again as they change. To fix it: ScapeStrategy({chosen.settings()})."
    )
    return Estimate(params, cluster, compute, base, methods, run_steps, text, predicted)


def _scape_int8_dense(
    param_groups: list[dict[str, Any]], cluster: Cluster, compute: StepCompute, cfg: ScapeConfig, run_steps: int | None
) -> MethodEstimate:
    """SCAPE with the int8 wire and a dense warm-up as long as the run: every step is a dense step."""
    cfg = cfg.replace(dense_warmup_steps=max(run_steps or 1, cfg.dense_warmup_steps))
    layout = scape_layout(param_groups, cluster.world_size, cfg)
    traffic = next(ScapeTraffic(layout, cfg).steps(1))
    step = step_time(traffic, compute, cluster)
    return MethodEstimate(
        name=SCAPE_INT8_DENSE,
        density=None,
        bytes_per_step=traffic.bytes_sent(cluster.world_size),
        step=step,
        memory=scape_memory(layout, cfg),
        run_s=None if run_steps is None else run_steps * step.total_s,
    )


def _scape(
    param_groups: list[dict[str, Any]],
    cluster: Cluster,
    compute: StepCompute,
    cfg: ScapeConfig,
    dense: dict[str, StepTraffic],
    run_steps: int | None,
    overlap_next: bool,
) -> MethodEstimate:
    """SCAPE at ``cfg``: its step after the schedule, the schedule's cost, and where it breaks even."""
    W = cluster.world_size
    factor = forms.STEPS_TO_LOSS.get(Form(cfg.wire_format or "full", cfg.sparse_density))
    layout = scape_layout(param_groups, W, cfg)
    traffic = ScapeTraffic(layout, cfg)
    steady = traffic.steady_state()
    extra = compute.extra(cfg.sparse_density)
    step = mean_step(steady, compute, cluster, extra, overlap_next)
    span = traffic.schedule_steps
    schedule = list(traffic.steps(max(span, 1)))
    times = [step_time(s, compute, cluster, 0.0 if t <= cfg.dense_steps else extra, overlap_next).total_s
             for t, s in enumerate(schedule[:span], start=1)]  # fmt: skip
    ddp_step = step_time(dense[DDP], compute, cluster)
    cost = schedule_cost(
        times, [s.bytes_sent(W) for s in schedule[:span]], cfg.dense_steps, ddp_step, dense[DDP].bytes_sent(W), step
    )

    def gain_at(reference: StepTraffic) -> Callable[[float], float]:
        def gain(bps: float) -> float:
            at = cluster.with_bandwidth(bps)
            scape_s = mean_step(steady, compute, at, extra, overlap_next).total_s * (factor or 1.0)
            return step_time(reference, compute, at).total_s - scape_s

        return gain

    run_s = None
    if run_steps is not None:
        run_s = sum(times[:run_steps]) + max(0, run_steps - span) * step.total_s
    return MethodEstimate(
        name=scape_name(cfg.sparse_density, cfg.wire_format),
        density=cfg.sparse_density,
        bytes_per_step=sum(s.bytes_sent(W) for s in steady) / len(steady),
        step=step,
        memory=scape_memory(layout, cfg),
        dense_bytes_per_step=schedule[0].bytes_sent(W) if cfg.dense_steps else None,
        extra_counted=compute.has_extra(cfg.sparse_density),
        steps_factor=factor,
        breakeven_bps={name: breakeven_bandwidth(gain_at(t)) for name, t in dense.items()},
        schedule=cost,
        run_s=run_s,
    )


def recommend(methods: Sequence[MethodEstimate], run_steps: int | None = None) -> str:
    """One sentence: the method to use, and why, from the predicted steps (and the run's length, if known).

    SCAPE's sparse steps are recommended over DDP's when they reach the same loss :data:`CLEAR_GAIN` sooner (their
    step times the steps their sparse phase needs, where measured), and over SCAPE's int8 dense steps (when
    estimated) when they are faster by the extra steps they need (:func:`_sparse_steps`); the int8 dense steps over
    DDP's when they are no slower (both step on the whole gradient).
    """
    dense = min((m for m in methods if m.density is None and m.name != SCAPE_INT8_DENSE), key=lambda m: m.step.total_s)
    scape = min((m for m in methods if m.density is not None), key=_time_to_loss)
    int8_dense = next((m for m in methods if m.name == SCAPE_INT8_DENSE), None)
    if int8_dense is not None and int8_dense.step.total_s / scape.step.total_s < _sparse_steps(scape):
        return _recommend_int8_dense(dense, int8_dense, scape, run_steps)
    gain = dense.step.total_s / _time_to_loss(scape)
    cost = scape.schedule
    share = dense.step.exposed_s / dense.step.total_s
    if gain >= CLEAR_GAIN and cost is not None and cost.ahead_from is not None:
        span = cost.dense_steps + cost.ramp_steps
        if run_steps is not None and run_steps < cost.ahead_from:
            return (
                f"Use {dense.name} for this run: {scape.name}'s steps are predicted {gain:.2f}x faster after its "
                f"{span}-step warm-up and ramp, but a run of {run_steps} steps ends before it is ahead (from step "
                f"{cost.ahead_from}); shorten --dense-warmup-steps and --density-ramp-steps, or train longer."
            )
        after = f"after its {span}-step warm-up and ramp " if span else ""
        return (
            f"Use {scape.name}: {after}it is predicted to reach the same loss {gain:.2f}x sooner than {dense.name}"
            f"{_counted(scape)}, and a run is ahead of {DDP}'s in steps from step {cost.ahead_from} on."
        )
    if gain > 1:
        return (
            f"{scape.name} is predicted to reach the same loss only {100 * (gain - 1):.0f}% sooner than {dense.name}"
            f"{_counted(scape)}: the network is not the bottleneck here ({share:.0%} of its step waits for "
            f"communication), so stay with {dense.name} unless the link is slower than this."
        )
    return (
        f"SCAPE does not pay here: {dense.name} is predicted to reach the same loss {1 / gain:.2f}x sooner than "
        f"{scape.name}{_counted(scape)} ({share:.0%} of its step waits for communication); use {dense.name}."
    )


def _time_to_loss(m: MethodEstimate) -> float:
    """``m``'s step times the steps it needs to the same loss (its step alone where those are not measured)."""
    return m.step.total_s * (m.steps_factor or 1.0)


def _sparse_steps(m: MethodEstimate) -> float:
    """The steps ``m``'s sparse phase needs to the same loss, as a multiple of dense steps: measured, or
    :data:`SPARSE_STEPS`."""
    return m.steps_factor or SPARSE_STEPS


def _counted(m: MethodEstimate) -> str:
    """What ``m``'s comparison counted."""
    if m.steps_factor is None:
        return " (per step: the steps it needs at this density are not measured)"
    return f" (its steps are {m.steps_factor:g}x as many)"


def _recommend_int8_dense(
    dense: MethodEstimate, int8_dense: MethodEstimate, scape: MethodEstimate, run_steps: int | None
) -> str:
    """The recommendation when SCAPE's sparse steps do not beat its int8 dense steps by :func:`_sparse_steps`."""
    gain = dense.step.total_s / int8_dense.step.total_s
    sparse = (
        f"{scape.name}'s steps are only {int8_dense.step.total_s / scape.step.total_s:.2f}x faster than "
        f"{int8_dense.name}'s, less than the {_sparse_steps(scape):g}x more steps its sparse phase needs to the same "
        "loss"
    )
    if gain >= 1.0:  # a quarter of DDP's bytes and AdamS's steps: no slower per step is enough
        steps = str(run_steps) if run_steps is not None else "the run's length"
        return (
            f'Use {int8_dense.name} (wire_format="int8", dense_warmup_steps={steps}): its steps are predicted '
            f"{gain:.2f}x faster than {dense.name}'s; {sparse}."
        )
    return (
        f"Stay with {dense.name}: {int8_dense.name}'s steps are predicted {100 * (1 / gain - 1):.0f}% slower (its "
        f"parameter all-gather is not hidden), and {sparse}."
    )
