"""The text ``lightning-scape estimate`` prints: the inputs, one row per method, where SCAPE pays, its schedule's
cost, and a recommendation."""

from __future__ import annotations

import math
import textwrap

from lightning_scape.planning.estimate import DDP, DDP_BF16, Estimate, MethodEstimate
from lightning_scape.planning.network import Link

WIDTH = 110  # columns of the printed prose (the table is as wide as it is)


def format_rate(bps: float) -> str:
    """``25 Gbit/s``, ``100 Mbit/s``; three significant digits."""
    for scale, unit in ((1e12, "Tbit/s"), (1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _below(bps: float) -> str:
    """Where a break-even rate lies, in words."""
    if math.isinf(bps):
        return "at every rate up to 10 Tbit/s"
    if bps == 0:
        return "at no rate down to 1 kbit/s"
    return f"below {format_rate(bps)}"


def _link(link: Link) -> str:
    latency = f"{1e3 * link.latency_s:g} ms latency" if link.latency_s else "no latency given"
    usable = format_rate(link.bandwidth_bps * link.efficiency)
    return f"{format_rate(link.bandwidth_bps)} ({usable} usable), {latency}"


def header(est: Estimate, model: str, compute_source: str) -> list[str]:
    """The inputs, as the estimate read them."""
    c, cfg = est.cluster, est.config
    where = f"between nodes {_link(c.link)}" if c.nodes > 1 else f"between its processes {_link(c.link)}"
    comp = est.compute
    extras = [
        f"{1e3 * comp.extra(m.density):.1f} ms at d={m.density:g}"
        for m in est.methods
        if m.density is not None and m.extra_counted
    ]
    ramp = f", then a {cfg.density_ramp_steps}-step geometric ramp" if cfg.dense_warmup_steps else ""
    return [
        f"Model: {model}, {est.params:,} parameters. Cluster: {c.nodes} node(s) x {c.procs_per_node} process(es) "
        f"(W = {c.world_size}); {where}.",
        f"Compute per step and rank ({compute_source}): {1e3 * comp.total_s:.1f} ms (forward "
        f"{1e3 * comp.forward_s:.1f}, backward {1e3 * comp.backward_s:.1f}, optimizer {1e3 * comp.optimizer_s:.1f}).",
        f"SCAPE: chunk_size {cfg.chunk_size}, {'sharded' if cfg.sharded else 'replicated'}, "
        f"{cfg.dense_warmup_steps} dense warm-up steps{ramp}; its own work per sparse step: "
        + (", ".join(extras) if extras else "not counted (give --scape-extra-ms, or --measure)")
        + ".",
    ]


def table(est: Estimate) -> list[str]:
    """One row per method."""
    ref = est.method(DDP).step.total_s
    head = f"{'method':<22} {'MB sent/rank/step':>17} {'step ms':>9} {'exposed comm ms':>15} {'step vs DDP':>11} "
    head += f"{'GB/rank':>8}"
    rows = [head]
    for m in est.methods:
        rows.append(
            f"{m.name:<22} {m.bytes_per_step / 1e6:>17.3f} {1e3 * m.step.total_s:>9.1f} "
            f"{1e3 * m.step.exposed_s:>15.1f} {ref / m.step.total_s:>10.2f}x {m.memory.total / 1e9:>8.2f}"
        )
    return rows


def _pays(m: MethodEstimate) -> str:
    """Where SCAPE at ``m``'s density reaches the same loss sooner than each dense method (per step where the steps
    its sparse phase needs are not measured)."""
    assert m.breakeven_bps is not None
    below = f"{DDP} {_below(m.breakeven_bps[DDP])}, and than {DDP_BF16} {_below(m.breakeven_bps[DDP_BF16])}"
    uncounted = "; its own work per step not counted: that lowers both rates" if not m.extra_counted else ""
    if m.steps_factor is None:
        return (
            f"{m.name}'s step is faster than {below} (per step only: the steps it needs to the same loss at this "
            f"density are not measured{uncounted})."
        )
    return f"{m.name} reaches the same loss sooner than {below} (x{m.steps_factor:g} the steps{uncounted})."


def _schedule(m: MethodEstimate) -> str:
    cost = m.schedule
    if cost is None or m.dense_bytes_per_step is None:
        return f"{m.name}: no dense warm-up; every step is sparse."
    span = cost.dense_steps + cost.ramp_steps
    ahead = f"its run is ahead from step {cost.ahead_from}" if cost.ahead_from else "its run never catches up"
    ddp = f"{DDP}: {cost.reference_s:.1f} s, {cost.reference_bytes / 1e9:.2f} GB"
    return (
        f"{m.name}: the first {cost.dense_steps} steps are dense ({m.dense_bytes_per_step / 1e6:.1f} MB each), the "
        f"next {cost.ramp_steps} ramp the density down; these {span} steps take {cost.scape_s:.1f} s and send "
        f"{cost.scape_bytes / 1e9:.2f} GB per rank ({ddp}). After them each step saves "
        f"{1e3 * cost.saving_per_step_s:.1f} ms: {ahead}."
    )


def format_estimate(est: Estimate, model: str, compute_source: str) -> str:
    """Everything ``lightning-scape estimate`` prints, its prose wrapped at :data:`WIDTH` columns.

    Args:
        est: The estimate.
        model: How the model was named (a litgpt config, or a parameter count).
        compute_source: Where the compute time came from ("given", "measured on ...").
    """
    lines = [_wrap(line) for line in header(est, model, compute_source)]
    lines += [
        "",
        *table(est),
        _wrap("Memory per rank: parameters, gradients, optimizer state and buffers; not activations."),
    ]
    lines += ["", "Where SCAPE pays (its steps after the schedule, times the steps it needs to the same loss):"]
    lines += [_wrap(_pays(m), indent="  ") for m in est.methods if m.breakeven_bps is not None]
    lines += ["", "Its warm-up and density ramp:"]
    lines += [_wrap(_schedule(m), indent="  ") for m in est.methods if m.density is not None]
    if est.run_steps is not None:
        runs = ", ".join(f"{m.name} {_duration(m.run_s or 0.0)}" for m in est.methods)
        lines += ["", _wrap(f"A run of {est.run_steps} steps: {runs}.")]
    if est.forms:
        lines += ["", "The forms SCAPE chooses from (ms per step x steps to the same loss = ms per step of progress):"]
        chosen = est.chosen_form
        for pred in sorted(est.forms, key=lambda p: p.time_to_loss):
            mark = "  <- chosen" if pred.form == chosen else ""
            lines.append(
                f"  {pred.form.name:<14} {1e3 * pred.step_s:9.1f} ms x {pred.steps_factor:<4g} = "
                f"{1e3 * pred.time_to_loss:9.1f} ms{mark}"
            )
    lines += ["", _wrap(f"Recommendation: {est.recommendation}")]
    lines.append(
        _wrap(
            "The steps to the same loss are the time-to-loss benchmark's (docs/benchmarks.md), SCAPE's loss at equal "
            "steps is in docs/algorithm.md section 7, the step model's check against measurements in "
            "docs/benchmarks.md."
        )
    )
    return "\n".join(lines)


def _wrap(text: str, indent: str = "") -> str:
    """``text`` wrapped at :data:`WIDTH` columns, every line after the first indented two more spaces."""
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
