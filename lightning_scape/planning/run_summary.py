"""What a run did with SCAPE, said at its end: the bytes sent against DDP's, the time spent waiting on
collectives, and the steps of each phase (dense warm-up, density ramp, sparse).

One summary for every way of running SCAPE: the strategies log it on rank 0 when a run ends
(:class:`~lightning_scape.runtime.scape_runtime.ScapeRuntime`: the Trainer's teardown; Fabric's teardown or the
process's exit), ``lightning-scape pretrain`` prints its lines inside its own summary (beside the throughput, the
logs and the checkpoint), and the demo's table writes bytes and ratios with the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_scape.config import DENSE_ABOVE, ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.planning.forms import FP32_DENSE
from lightning_scape.planning.pilot import FormPilot

# The labels of the summary's lines are padded to this width, so that their texts line up.
LABEL_WIDTH = 15
HEADING = "lightning_scape: SCAPE run summary (rank 0's counts)"


def summary_line(label: str, text: str) -> str:
    """One line of a summary: ``  label:        text``, the texts of all lines aligned."""
    return f"  {label + ':':<{LABEL_WIDTH}}{text}"


def format_bytes(nbytes: float) -> str:
    """Bytes in the unit that keeps three significant digits or more: ``"110 B"``, ``"43.1 kB"``, ``"104.52 MB"``."""
    if abs(nbytes) >= 1e9:
        return f"{nbytes / 1e9:.2f} GB"
    if abs(nbytes) >= 1e6:
        return f"{nbytes / 1e6:.2f} MB"
    if abs(nbytes) >= 1e3:
        return f"{nbytes / 1e3:.1f} kB"
    return f"{nbytes:.0f} B"


def times_fewer(dense_equivalent: float, sent: float) -> str:
    """How many times fewer bytes than DDP, e.g. ``"79.6x"`` (a run that sent nothing counts as 1 byte)."""
    return f"{dense_equivalent / max(1.0, sent):.1f}x"


@dataclass(frozen=True)
class Phases:
    """The optimizer steps of a run so far, by what SCAPE sent in them.

    Attributes:
        warmup: Steps of the dense warm-up (``dense_warmup_steps``).
        dense_after_warmup: Further steps sent dense because their density is above 1/4 (``DENSE_ABOVE``): the
            first steps of the density ramp, or every step up to ``ScapeConfig.dense_steps`` when ``density``
            itself is above 1/4.
        sparse_ramp: Sparse steps on the density ramp.
        at_density: Sparse steps at ``density``.
    """

    warmup: int
    dense_after_warmup: int
    sparse_ramp: int
    at_density: int

    @property
    def dense(self) -> int:
        """Steps that sent the whole gradient, as DDP does."""
        return self.warmup + self.dense_after_warmup


def phases(config: ScapeConfig, steps: int) -> Phases:
    """The first ``steps`` optimizer steps of ``config``'s schedule, by phase (the engine's own boundaries)."""
    dense = min(steps, config.dense_steps)
    warmup = min(dense, config.dense_warmup_steps)
    # The ramp follows a warm-up only (ScapeConfig.ramp_density), and its last step is at density: without a
    # warm-up every sparse step is at density.
    at_density_from = config.dense_warmup_steps + config.density_ramp_steps if config.dense_warmup_steps else 0
    sparse_ramp = max(0, min(steps, at_density_from - 1) - config.dense_steps)
    return Phases(warmup, dense - warmup, sparse_ramp, steps - dense - sparse_ramp)


def describe_steps(engine: ScapeEngine) -> str:
    """The engine's steps by phase (:func:`describe_phases`), or where SCAPE chose the form, by form: ``"500, in the
    forms SCAPE chose: fp32 dense 1-30; int8 d=0.025 31-500 (through a 400-step density ramp)"``."""
    pilot = engine.pilot
    if not isinstance(pilot, FormPilot):
        return describe_phases(engine.config, engine.step_count)
    spans = [(0, FP32_DENSE), *pilot.switches]
    ends = [start for start, _ in spans[1:]] + [engine.step_count]
    parts = []
    for (start, form), end in zip(spans, ends, strict=True):
        ramp = "" if form.dense else f" (through a {engine.config.density_ramp_steps}-step density ramp)"
        parts.append(f"{form.name} {start + 1}-{end}{ramp}")
    if pilot.last_decision_step is None:
        parts[-1] += ", measuring the link"
    return f"{engine.step_count}, in the forms SCAPE chose: " + "; ".join(parts)


def describe_phases(config: ScapeConfig, steps: int) -> str:
    """``"500: 30 dense warm-up (...), 120 dense on the density ramp (...), 279 sparse on the density ramp, 71 sparse
    at density 0.01"``: the steps taken, by phase; phases with no step are left out."""
    p = phases(config, steps)
    above = f"density={config.sparse_density:g} is above 1/4, so they are sent dense"
    parts = [
        (p.warmup, f"{p.warmup} dense warm-up (dense_warmup_steps={config.dense_warmup_steps})"),
        (
            p.dense_after_warmup,
            f"{p.dense_after_warmup} dense on the density ramp (denser than 1/4)"
            if config.sparse_density <= DENSE_ABOVE
            else f"{p.dense_after_warmup} dense ({above})",
        ),
        (p.sparse_ramp, f"{p.sparse_ramp} sparse on the density ramp"),
        (p.at_density, f"{p.at_density} sparse at density {config.sparse_density:g}"),
    ]
    return f"{steps}: " + ", ".join(text for count, text in parts if count)


def communication(engine: ScapeEngine, baseline: str = "DDP") -> str:
    """What the engine's rank sent over the run, against what ``baseline`` would have sent, and in its last step
    when that step was sparse."""
    c = engine.counters
    if c.total_dense_equivalent == 0:  # one process (or one replica group): nothing to send
        return f"none: one replica, so SCAPE has nothing to send and its steps are AdamS's ({baseline} sends nothing)"
    sent, dense = c.total_sent_bytes, c.total_dense_equivalent
    saved = dense - sent
    text = f"{format_bytes(sent)} sent per process; {baseline} would have sent {format_bytes(dense)}: "
    if saved >= 0:
        text += f"{format_bytes(saved)} saved ({times_fewer(dense, sent)} fewer"
    else:  # a run that ends in its dense steps sends a little more: the first sparse step's mask, built ahead
        text += f"{format_bytes(-saved)} more ({sent / dense:.2f}x {baseline}'s"
    if c.step_sent["dense"] == 0 and c.step_dense_equivalent > 0:  # the last step was sparse
        last, last_dense = c.step_sent_bytes, c.step_dense_equivalent
        text += f"; {format_bytes(last)} in the last step, {times_fewer(last_dense, last)} fewer"
    return text + ")"


def waiting(engine: ScapeEngine) -> str:
    """The time the engine's rank was blocked on SCAPE's collectives: the communication compute did not hide."""
    c, steps = engine.counters, max(1, engine.step_count)
    return (
        f"{c.total_wait_s:.2f} s blocked on SCAPE's collectives ({1e3 * c.total_wait_s / steps:.1f} ms per step): "
        "the communication that compute did not hide"
    )


def summary_lines(engine: ScapeEngine, baseline: str = "DDP") -> list[str]:
    """The communication, waiting and steps lines of one engine's run (counted since the run began, a resumed run
    included)."""
    return [
        summary_line("communication", communication(engine, baseline)),
        summary_line("waiting", waiting(engine)),
        summary_line("steps", describe_steps(engine)),
    ]


def summary_text(engines: Sequence[ScapeEngine], baseline: str = "DDP") -> str:
    """The summary of a run's engines (normally one), under :data:`HEADING`."""
    lines = [HEADING]
    for i, engine in enumerate(engines):
        if len(engines) > 1:
            lines.append(f"  optimizer {i}:")
        lines += summary_lines(engine, baseline)
    return "\n".join(lines)
