"""Step times from the collectives, the compute and the network: DDP, its bf16 hook and SCAPE.

The overlap model (``docs/benchmarks.md``, "Predicted against measured"):

- A step computes forward, backward and the optimizer step; its collectives run on the network model of
  :mod:`~lightning_scape.planning.network`, one after the other.
- The collectives launched bucket by bucket during the backward pass (DDP's all-reduces, SCAPE's value
  reduce-scatters) overlap it: with n buckets whose gradients arrive evenly, what is left after the backward
  pass is ``max(last bucket's time, all of them - backward * (1 - 1/n))``.
- What the optimizer step waits for (SCAPE's clipping scalar and parameter all-gathers) is not hidden.
- SCAPE's mask index all-gathers overlap the next forward pass (only what exceeds it shows).
- A SCAPE sparse step also does the engine's own work (error feedback, mask selection, the sparse update,
  the scatter): ``StepCompute.scape_extra_s``, measured per density; its dense steps cost what DDP's
  optimizer step costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_scape.planning.network import Cluster
from lightning_scape.planning.traffic import StepTraffic

# The break-even search looks between these rates (bits per second): 1 kbit/s to 10 Tbit/s.
LOWEST_BPS, HIGHEST_BPS = 1e3, 1e13


@dataclass(frozen=True)
class StepCompute:
    """One rank's step without communication, split as the overlap model needs it (seconds).

    Attributes:
        forward_s: The forward pass.
        backward_s: The backward pass (the time DDP's all-reduces can hide under).
        optimizer_s: The dense optimizer step (DDP's AdamW, SCAPE's dense steps), clipping included.
        scape_extra_s: Per density, what a SCAPE sparse step adds to ``optimizer_s`` on this rank (error
            feedback, mask selection, the sparse update, the scatter). A density without an entry counts
            nothing extra (``has_extra`` tells).
    """

    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    scape_extra_s: Mapping[float, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "optimizer_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"StepCompute.{name} must be >= 0 seconds, got {value!r}.")

    @classmethod
    def from_total(cls, total_s: float, scape_extra_s: Mapping[float, float] | None = None) -> StepCompute:
        """A step of ``total_s`` seconds, split 1:2 between forward and backward (a transformer's ratio)."""
        if not total_s > 0:
            raise ValueError(f"The compute time must be > 0 seconds, got {total_s!r}.")
        return cls(total_s / 3, 2 * total_s / 3, 0.0, dict(scape_extra_s or {}))

    @property
    def total_s(self) -> float:
        """Forward, backward and the dense optimizer step."""
        return self.forward_s + self.backward_s + self.optimizer_s

    def has_extra(self, density: float) -> bool:
        """Whether SCAPE's own work at ``density`` is known."""
        return density in self.scape_extra_s

    def extra(self, density: float) -> float:
        """SCAPE's own work per sparse step at ``density`` (0 when unknown)."""
        return self.scape_extra_s.get(density, 0.0)


@dataclass(frozen=True)
class StepTime:
    """A predicted step (seconds).

    Attributes:
        total_s: The step.
        exposed_s: Its communication that compute does not hide.
        wire_s: All its communication, hidden or not.
    """

    total_s: float
    exposed_s: float
    wire_s: float


def step_time(
    traffic: StepTraffic, compute: StepCompute, cluster: Cluster, extra_s: float = 0.0, overlap_next: bool = True
) -> StepTime:
    """One step's time under the overlap model.

    Args:
        traffic: The step's collectives.
        compute: The rank's compute.
        cluster: The network.
        extra_s: Work the step adds to ``compute`` (SCAPE's engine on a sparse step).
        overlap_next: Whether the index all-gathers overlap the next forward pass (False: they are waited
            on at the end of the step, as the network benchmark does to charge them to SCAPE).
    """
    seconds = cluster.seconds
    during = sum(seconds(c) for c in traffic.backward)
    launches = sum(c.count for c in traffic.backward)
    exposed_bwd = 0.0
    if launches:
        last = cluster.seconds_each(traffic.backward[-1])
        exposed_bwd = max(last, during - compute.backward_s * (1 - 1 / launches))
    after = sum(seconds(c) for c in traffic.after)
    nxt = sum(seconds(c) for c in traffic.next_forward)
    exposed_nxt = max(0.0, nxt - compute.forward_s) if overlap_next else nxt
    exposed = exposed_bwd + after + exposed_nxt
    return StepTime(compute.total_s + extra_s + exposed, exposed, during + after + nxt)


def mean_step(
    steps: Sequence[StepTraffic], compute: StepCompute, cluster: Cluster, extra_s: float, overlap_next: bool
) -> StepTime:
    """The mean of :func:`step_time` over ``steps`` (the steps that repeat)."""
    times = [step_time(s, compute, cluster, extra_s, overlap_next) for s in steps]
    n = len(times)
    return StepTime(*(sum(getattr(t, f) for t in times) / n for f in ("total_s", "exposed_s", "wire_s")))


def breakeven_bandwidth(gain_at: Callable[[float], float]) -> float:
    """The link rate below which SCAPE's step is the faster: where ``gain_at(bps)`` (reference minus SCAPE) is 0.

    Bisection on the logarithm of the rate between 1 kbit/s and 10 Tbit/s; ``gain_at`` is taken to fall as
    the rate grows (the reference sends more bytes).

    Returns:
        The rate in bits per second; ``math.inf`` when SCAPE is as fast or faster at every rate up to
        10 Tbit/s, 0.0 when it is slower even at 1 kbit/s.
    """
    lo, hi = math.log(LOWEST_BPS), math.log(HIGHEST_BPS)
    if gain_at(HIGHEST_BPS) >= 0:
        return math.inf
    if gain_at(LOWEST_BPS) <= 0:
        return 0.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if gain_at(math.exp(mid)) > 0:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


@dataclass(frozen=True)
class ScheduleCost:
    """What SCAPE's dense warm-up and density ramp cost against a reference run of as many steps.

    Attributes:
        dense_steps: Steps sent dense (the warm-up and the ramp's steps denser than 1/4).
        ramp_steps: The ramp's sparse steps (above the final density).
        scape_s: SCAPE's time over those steps.
        reference_s: The reference's time over as many steps.
        scape_bytes: SCAPE's bytes per rank over those steps.
        reference_bytes: The reference's bytes per rank over as many steps.
        saving_per_step_s: Per step after the schedule, the reference's step minus SCAPE's.
        ahead_from: The first step from which SCAPE's run stays ahead of the reference's in wall-clock
            (None: never).
    """

    dense_steps: int
    ramp_steps: int
    scape_s: float
    reference_s: float
    scape_bytes: int
    reference_bytes: int
    saving_per_step_s: float
    ahead_from: int | None


def schedule_cost(step_s: Sequence[float], step_bytes: Sequence[int], dense_steps: int, reference: StepTime,
                  reference_bytes: int, steady: StepTime) -> ScheduleCost:  # fmt: skip
    """:class:`ScheduleCost` from SCAPE's per-step times and bytes over its schedule.

    Args:
        step_s: SCAPE's step times over the schedule (the warm-up and the ramp).
        step_bytes: Its bytes per step over the schedule.
        dense_steps: How many of them are dense.
        reference: The reference's step.
        reference_bytes: The reference's bytes per step.
        steady: SCAPE's step after the schedule.
    """
    span = len(step_s)
    saving = reference.total_s - steady.total_s
    behind = [0.0]  # SCAPE's time minus the reference's, after each step
    for s in step_s:
        behind.append(behind[-1] + s - reference.total_s)
    ahead_from: int | None = None
    if behind[-1] <= 0 and saving >= 0:  # ahead by the end of the schedule: from after the last step behind
        ahead_from = next((t + 1 for t in range(span, 0, -1) if behind[t] > 0), 1)
    elif saving > 0:
        ahead_from = span + math.ceil(behind[-1] / saving)
    return ScheduleCost(
        dense_steps=dense_steps,
        ramp_steps=span - dense_steps,
        scape_s=sum(step_s),
        reference_s=span * reference.total_s,
        scape_bytes=sum(step_bytes),
        reference_bytes=span * reference_bytes,
        saving_per_step_s=saving,
        ahead_from=ahead_from,
    )
