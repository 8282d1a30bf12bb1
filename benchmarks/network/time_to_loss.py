"""Time to the same validation loss: SCAPE against DDP, PowerSGD and the bf16 hook on an emulated slow network.

    sudo .venv/bin/python -m benchmarks.network.time_to_loss --profile 100mbit --out out/ttl_w2_small_100mbit
    .venv/bin/python -m benchmarks.network.time_to_loss --report out/ttl_w2_small_* --out out/ttl_report
    .venv/bin/python -m benchmarks.network.time_to_loss --loopback --model tiny --steps 6 --eval-every 2   # no root

The machinery of ``benchmarks.network.run`` (``harness.py``: hosts in network namespaces behind
token-bucket-limited veths, ``netns.py``; every method in the same W processes, one optimizer step each per
round in rotating order, barrier between, ``worker.py``), with training long enough for the loss to flatten:
every method trains the same model from the same initial weights on the same batches for ``--steps`` steps (SCAPE for
``--scape-steps``; the sized budget gives it twice as many: it spends the time its cheaper steps save on more
of them, as a user on a slow network would), each under the quality benchmark's cosine learning rate over its
own budget (peak 1.5e-3, 20 ramp steps, 0 at the last step), 8 x 128 tokens per rank and step, and is evaluated
on the same fixed validation batches (``lightning_scape.examples.workloads``) before the first step, every
``--eval-every`` steps and after the last, in the same rounds, outside the clock.

A method's wall-clock is the sum of its measured step times (each step: the slowest rank). Within a round
the methods run seconds apart, so the machine's drifting load hits them alike and cancels in the sums.

Per profile the outputs give, against the target L* = DDP + AdamW's final validation loss (and 1.05 L*):
the wall-clock, steps and bytes (package counters and interface counters) each method needs to reach it,
linearly interpolated between evaluations ("not reached" when its curve never gets there); the validation
loss each method has at equal wall-clock (DDP + AdamW's total, and the fastest method's total); and plots of
validation loss against wall-clock and against step. ``results.md``, ``results.csv``, ``curves.csv``,
``results.json``, ``headline.md`` (the README's table) and per profile ``val_loss_vs_time.png`` and
``val_loss_vs_step.png`` go to ``--out``; ``--report DIR ...`` merges finished runs into one
``results.md``/``headline.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.network import harness
from benchmarks.network.netns import PROFILES, Host
from benchmarks.network.worker import (
    FSDP_METHODS,
    METHOD_LABELS,
    TTL_METHODS,
    TTL_SCAPE_METHODS,
    WorkerSpec,
    ttl_scape_config,
)
from benchmarks.reporting import (
    cumsum,
    fmt,
    goodput_cell,
    machine_line,
    mean,
    method_style,
    network_column,
    network_mode,
    pyplot,
    write_csv,
    write_json,
)
from lightning_scape import ScapeConfig
from lightning_scape.examples.workloads import MODEL_PRESETS

# Not part of "all": the model sharded inside each host (--ranks-per-host ranks) and replicated across hosts.
TTL_FSDP_METHODS: tuple[str, ...] = ("hsdp_adamw", "scape_fsdp_default_d0.01")
# The methods that get SCAPE's step budget (--scape-steps): those with sparse steps (every step of
# scape_int8_dense is dense, so it trains DDP's budget, as DDP + AdamS does).
SCAPE_BUDGET_METHODS: tuple[str, ...] = (
    *(m for m in TTL_SCAPE_METHODS if not m.endswith("_dense")),
    "scape_fsdp_default_d0.01",
)
assert set(TTL_FSDP_METHODS) <= set(FSDP_METHODS)
DDP = "ddp_adamw"  # the reference: its final validation loss is the target
TARGET_FACTORS: tuple[float, ...] = (1.0, 1.05)

# 8 x 128 tokens per rank at peak 1.5e-3 (20 ramp steps, cosine to 0, AdamW/AdamS): the quality benchmark's
# learning rate, tuned for DDP + AdamS (docs/benchmarks.md, Quality); at W = 4 the global batch, 32 x 128, is
# benchmarks/quality.py's. The step-time mode's 4 x 128 at 2e-3 is noisy (train losses jump by
# 0.2 from step to step); quality.py's 16 x 128 per rank doubles the compute of every step, which on this
# machine halves the steps an hour holds for the base model (80 instead of 150 at 100 Mbit/s, measured), below
# SCAPE's 150 dense steps at the defaults. docs/benchmarks.md (Time to loss) has the measurements.
BATCH_SIZE = 8
BLOCK_SIZE = 128
PEAK_LR = 1.5e-3
LR_WARMUP = 20
EVAL_BATCHES = 8  # 8 x 16 windows of 128 bytes: 16k validation tokens, the same windows for every method
EVAL_POINTS = 15  # evaluations per run (plus the one before the first step) when --eval-every is not given

# `--steps auto`: (steps, SCAPE's steps, eval_every) by (model, world size), sized on the 2-core VM of
# docs/benchmarks.md with nothing else running: small W = 2 at 100 Mbit/s took 29 min (1.06 s a round, 1.1 s an
# evaluation), at 1 Gbit/s 15 min, at 10 Gbit/s 14 min. At equal steps SCAPE at d = 0.01 ends 2-3% above DDP + AdamS
# (docs/algorithm.md section 7), so with DDP's budget it never reaches DDP's final loss; with twice the steps, each
# a quarter of DDP's time at 100 Mbit/s, it does. Small W = 4 (the same tokens in half the steps): 29 min at
# 100 Mbit/s (2.08 s a round: 4 processes on 2 cores), 16 min at 1 Gbit/s. The base model's W = 2 rounds took
# 9-24 s (under load): an hour holds 150-400 of them, and SCAPE's warm-up and density ramp take 430 steps, so it
# has no budget here.
BUDGETS: dict[tuple[str, int], tuple[int, int, int]] = {
    ("small", 2): (800, 1600, 50),
    ("small", 4): (400, 800, 25),
}


# ------------------------------------------------------------------------------------------ the arithmetic


@dataclass(frozen=True)
class CurvePoint:
    """One evaluation of one method: where it was when evaluated, and its validation loss.

    Args:
        step: Optimizer steps done (0: before the first).
        time_s: Sum of the method's measured step times up to here (outside-the-clock evaluations excluded).
        loss: Validation loss.
        sent_bytes: Bytes sent per rank up to here, package counters.
        tx_bytes: Bytes sent per rank up to here, interface counters (NaN on loopback).
    """

    step: int
    time_s: float
    loss: float
    sent_bytes: float = 0.0
    tx_bytes: float = math.nan


@dataclass(frozen=True)
class Crossing:
    """Where a curve first reaches a target loss, linearly interpolated between two evaluations.

    Every field is interpolated at the same fraction of the segment, the one at which the loss line meets
    the target.
    """

    target: float
    time_s: float
    step: float
    sent_bytes: float
    tx_bytes: float


def time_to_target(points: Sequence[CurvePoint], target: float) -> Crossing | None:
    """Where ``points`` first reach ``target`` (loss at or below it), or None when they never do.

    The crossing lies on the segment between the last evaluation above the target and the first at or
    below it: a curve that dips below the target and comes back up has reached it at the dip.

    Args:
        points: One method's evaluations, in step order.
        target: The loss to reach.

    Returns:
        The interpolated crossing; the first point itself if it is already at or below ``target``; None
        when no evaluation is at or below it (the run ended first).

    Raises:
        ValueError: ``points`` is empty or not in increasing step order.
    """
    _check(points)
    for i, p in enumerate(points):
        if p.loss <= target:
            if i == 0:
                return Crossing(target, p.time_s, float(p.step), p.sent_bytes, p.tx_bytes)
            a = points[i - 1]
            f = (a.loss - target) / (a.loss - p.loss)  # a.loss > target >= p.loss, so 0 < f <= 1
            return Crossing(
                target,
                a.time_s + f * (p.time_s - a.time_s),
                a.step + f * (p.step - a.step),
                a.sent_bytes + f * (p.sent_bytes - a.sent_bytes),
                a.tx_bytes + f * (p.tx_bytes - a.tx_bytes),
            )
    return None


def loss_at_time(points: Sequence[CurvePoint], t: float) -> tuple[float, bool]:
    """The validation loss of a method at wall-clock ``t``, linearly interpolated between evaluations.

    Args:
        points: One method's evaluations, in step order (the first at time 0).
        t: Seconds of the method's own step time.

    Returns:
        ``(loss, finished)``: ``finished`` is True when the run ended before ``t`` (its step budget took less
        time); the loss is then its final one, the best this budget gives it by ``t``.

    Raises:
        ValueError: ``points`` is empty or unordered, or ``t`` is before the first point.
    """
    _check(points)
    if t < points[0].time_s:
        raise ValueError(f"t = {t} s lies before the first evaluation (at {points[0].time_s} s).")
    for a, b in itertools.pairwise(points):
        if t <= b.time_s:
            if b.time_s == a.time_s:
                return b.loss, False
            f = (t - a.time_s) / (b.time_s - a.time_s)
            return a.loss + f * (b.loss - a.loss), False
    last = points[-1]
    return last.loss, t > last.time_s


def _check(points: Sequence[CurvePoint]) -> None:
    if not points:
        raise ValueError("a curve needs at least one evaluation.")
    for a, b in itertools.pairwise(points):
        if b.step <= a.step or b.time_s < a.time_s:
            raise ValueError(f"evaluations out of order: step {a.step} at {a.time_s} s, then {b.step} at {b.time_s} s.")


def _at(cum: Sequence[float], step: int) -> float:
    """Cumulative value after ``step`` steps (0 before the first)."""
    return cum[step - 1] if step > 0 else 0.0


# ------------------------------------------------------------------------------------------- the summary


def method_curve(recs: Sequence[dict[str, Any]], emulated: bool) -> dict[str, Any]:
    """One method's per-step times, bytes and evaluations, from every rank's record of it.

    Args:
        recs: ``rank<r>.json["methods"][name]`` of every rank.
        emulated: Whether the interface counters belong to the rank (False on loopback: ``lo`` is shared).

    Returns:
        ``step_s`` (slowest rank per step), ``cum_time_s``, ``train_loss`` (mean over ranks), ``points``
        (the evaluations as :class:`CurvePoint`), ``sent_bytes`` and ``tx_bytes`` (per rank, whole run).
    """
    steps = len(recs[0]["step_s"])
    step_s = [max(r["step_s"][i] for r in recs) for i in range(steps)]
    cum_t = cumsum(step_s)
    cum_sent = cumsum([mean([float(r["sent"][i]) for r in recs]) for i in range(steps)])
    cum_tx = cumsum([mean([float(r["tx"][i]) for r in recs]) for i in range(steps)])
    if not emulated:
        cum_tx = [math.nan] * steps
    # Every rank holds the same validation loss (one all-reduce of the per-batch losses); rank 0's is used.
    points = [
        CurvePoint(s, _at(cum_t, s), float(v), _at(cum_sent, s), _at(cum_tx, s) if emulated else math.nan)
        for s, v in zip(recs[0]["val_step"], recs[0]["val_loss"], strict=True)
    ]
    return {
        "step_s": step_s,
        "cum_time_s": cum_t,
        "train_loss": [mean([r["loss"][i] for r in recs]) for i in range(steps)],
        "points": points,
        "sent_bytes": cum_sent[-1] if steps else 0.0,
        "tx_bytes": cum_tx[-1] if steps else math.nan,
        "eval_s": sum(max(r["eval_s"][i] for r in recs) for i in range(len(recs[0]["eval_s"]))),
    }


def summarize_ttl(ranks: list[dict[str, Any]], methods: list[str], emulated: bool) -> dict[str, Any]:
    """Time to target, loss at equal time and bytes per method, from the per-rank records of one profile.

    Args:
        ranks: The workers' ``rank<r>.json`` contents, by rank.
        methods: The methods, in table order; must include ``ddp_adamw`` (the reference).
        emulated: Whether the interface counters belong to the ranks.

    Returns:
        ``per_method`` (one dict per method), ``targets`` (factor -> loss), ``ddp_total_s``,
        ``fastest_total_s``, ``fastest_method`` and ``world_size``.

    Raises:
        ValueError: ``ddp_adamw`` is not among the methods, or a record holds no evaluation.
    """
    if DDP not in methods:
        raise ValueError(f"the time-to-loss summary needs {DDP!r} (the reference) among the methods, got {methods}.")
    curves = {name: method_curve([rk["methods"][name] for rk in ranks], emulated) for name in methods}
    for name, c in curves.items():
        if not c["points"]:
            raise ValueError(f"{name} has no validation loss: the run had no evaluation (--eval-every 0?).")
    ref = curves[DDP]
    targets = {f: f * ref["points"][-1].loss for f in TARGET_FACTORS}
    ref_cross = {f: time_to_target(ref["points"], t) for f, t in targets.items()}
    totals = {name: c["cum_time_s"][-1] for name, c in curves.items()}
    fastest = min(totals, key=lambda n: totals[n])
    t_ddp, t_fast = totals[DDP], totals[fastest]
    per: dict[str, dict[str, Any]] = {}
    for name, c in curves.items():
        pts: list[CurvePoint] = c["points"]
        rec0 = ranks[0]["methods"][name]
        steps = len(c["step_s"])
        half = c["step_s"][steps // 2 :] or c["step_s"]
        p: dict[str, Any] = {
            "method": name,
            "label": METHOD_LABELS.get(name, name),
            "steps": steps,
            "total_s": totals[name],
            "step_ms_median": 1e3 * statistics.median(c["step_s"]),
            "step_ms_median_second_half": 1e3 * statistics.median(half),
            "final_val_loss": pts[-1].loss,
            "min_val_loss": min(q.loss for q in pts),
            "final_train_loss": mean(c["train_loss"][-10:]),
            "sent_bytes_run": c["sent_bytes"],
            "tx_bytes_run": c["tx_bytes"],
            "eval_s": c["eval_s"],
        }
        for f, target in targets.items():
            key = _tkey(f)
            cross = time_to_target(pts, target)
            rc = ref_cross[f]
            p[f"{key}_target"] = target
            p[f"{key}_reached"] = cross is not None
            at = (cross.time_s, cross.step, cross.sent_bytes, cross.tx_bytes) if cross else (math.nan,) * 4
            for field_name, v in zip(("time_s", "steps", "sent_bytes", "tx_bytes"), at, strict=True):
                p[f"{key}_{field_name}"] = v
            if cross is not None and rc is not None and rc.time_s > 0 and rc.step > 0 and cross.step > 0:
                # time ratio = steps ratio x (seconds per step up to the target) ratio: what the time goes to.
                p[f"{key}_time_vs_ddp"] = cross.time_s / rc.time_s
                p[f"{key}_steps_vs_ddp"] = cross.step / rc.step
                p[f"{key}_step_time_vs_ddp"] = (cross.time_s / cross.step) / (rc.time_s / rc.step)
            else:
                for k in ("time_vs_ddp", "steps_vs_ddp", "step_time_vs_ddp"):
                    p[f"{key}_{k}"] = math.nan
        for tag, t in (("at_ddp_time", t_ddp), ("at_fastest_time", t_fast)):
            loss, finished = loss_at_time(pts, t)
            p[f"loss_{tag}"] = loss
            p[f"finished_before_{tag}"] = finished
        p["points"] = [vars(q) for q in pts]
        p["train_loss"] = c["train_loss"]
        p["cum_time_s"] = c["cum_time_s"]
        for k in ("config", "powersgd", "slots", "effective_density", "decisions"):
            if k in rec0:
                p[k] = rec0[k]
        per[name] = p
    r0 = ranks[0]
    rounds, evals = r0.get("round_s", []), r0.get("eval_round_s", [])
    return {
        "per_method": per,
        # Rank 0's whole rounds and evaluations (barriers included), for sizing budgets: see sizing_line.
        "round_s_mean": mean(rounds),
        "round_s_median": statistics.median(rounds) if rounds else math.nan,
        # The evaluation before the first step is one method's (they share their weights): not a full one.
        "eval_round_s_mean": mean(evals[1:] or evals),
        "evaluations": len(evals),
        "setup_s": r0.get("setup_s", math.nan),
        "targets": {str(f): t for f, t in targets.items()},
        "ddp_total_s": t_ddp,
        "fastest_total_s": t_fast,
        "fastest_method": fastest,
        "world_size": len(ranks),
    }


def _tkey(factor: float) -> str:
    """Field prefix of a target: ``to_1.00`` (DDP + AdamW's final loss), ``to_1.05``."""
    return f"to_{factor:.2f}"


# ----------------------------------------------------------------------------------------------- the tables


def _mb(v: float) -> str:
    return fmt(v / 1e6, ".1f") if not math.isnan(v) else "n/a"


def _secs(v: float) -> str:
    """Seconds: whole above 100 s, three significant digits below (smoke runs take fractions of a second)."""
    if math.isnan(v):
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _time_cell(p: dict[str, Any], f: float, short: bool = False) -> str:
    """Seconds to the target and the multiple of DDP + AdamW's; not reached: the best loss and its gap."""
    key = _tkey(f)
    if not p[f"{key}_reached"]:
        gap = p["min_val_loss"] / p[f"{key}_target"] - 1
        return f"not reached ({gap:+.1%})" if short else f"not reached (best {p['min_val_loss']:.4f}, {gap:+.2%})"
    return f"{_secs(p[f'{key}_time_s'])} s ({fmt(p[f'{key}_time_vs_ddp'], '.2f')}x)"


def profile_tables(prof: dict[str, Any], emulated: bool) -> list[str]:
    """The markdown of one profile: its header, the time-to-target table and the equal-time/bytes table."""
    s = prof["summary"]
    per = s["per_method"]
    t1, t105 = s["targets"]["1.0"], s["targets"]["1.05"]
    tput = prof.get("throughput_bps")
    rate = f"{prof['rate_mbit']:.0f} Mbit/s per direction" if prof.get("rate_mbit") else "no rate limit (loopback)"
    fastest = per[s["fastest_method"]]["label"]
    md = [
        f"## {prof['profile']}: W = {prof['world_size']}, `{prof['model']}` model",
        "",
        f"{rate}; measured TCP goodput host 0 -> 1: {goodput_cell(tput)} Mbit/s. "
        f"{_budget(prof)} of W x {prof['batch_size']} x {prof['block_size']} tokens, validation every "
        f"{prof['eval_every']} steps, seed {prof.get('seed', 0)}; profile wall-clock {prof['wall_s'] / 60:.1f} min "
        "(evaluations included).",
        f"Target L* = DDP + AdamW's final validation loss = **{t1:.4f}**; 1.05 L* = {t105:.4f}. "
        f"DDP + AdamW's run: {_secs(s['ddp_total_s'])} s; the fastest run: {fastest}, "
        f"{_secs(s['fastest_total_s'])} s.",
        "",
        "Time to the target (seconds of step time; x DDP + AdamW's time to the same target). The time ratio is "
        "the product of the steps ratio and the seconds-per-step ratio (both up to the target):",
        "",
        "| method | final val loss | run s | to L*: s (x DDP) | steps | steps x DDP | s/step x DDP "
        "| to 1.05 L*: s (x DDP) | steps | steps x DDP | s/step x DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in per.values():
        cells = [p["label"], fmt(p["final_val_loss"], ".4f"), _secs(p["total_s"])]
        for f in TARGET_FACTORS:
            key = _tkey(f)
            cells += [
                _time_cell(p, f),
                fmt(p[f"{key}_steps"], ".0f"),
                fmt(p[f"{key}_steps_vs_ddp"], ".2f"),
                fmt(p[f"{key}_step_time_vs_ddp"], ".2f"),
            ]
        md.append("| " + " | ".join(cells) + " |")
    kern = "kernel" if emulated else "kernel: n/a on loopback"
    md += [
        "",
        f"Validation loss at equal wall-clock (* = the run had ended earlier: its final loss) and MB sent per rank "
        f"(package counters / interface `tx_bytes`, {kern}):",
        "",
        f"| method | loss @ DDP's {_secs(s['ddp_total_s'])} s | loss @ fastest's {_secs(s['fastest_total_s'])} s "
        "| MB to L* | MB to 1.05 L* | MB whole run | median step ms (all / 2nd half) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in per.values():

        def loss_cell(tag: str, p: dict[str, Any] = p) -> str:
            return fmt(p[f"loss_{tag}"], ".4f") + ("*" if p[f"finished_before_{tag}"] else "")

        def bytes_cell(prefix: str, p: dict[str, Any] = p) -> str:
            return f"{_mb(p[f'{prefix}sent_bytes'])} / {_mb(p[f'{prefix}tx_bytes'])}"

        md.append(
            f"| {p['label']} | {loss_cell('at_ddp_time')} | {loss_cell('at_fastest_time')} "
            f"| {bytes_cell('to_1.00_')} | {bytes_cell('to_1.05_')} "
            f"| {_mb(p['sent_bytes_run'])} / {_mb(p['tx_bytes_run'])} "
            f"| {fmt(p['step_ms_median'], '.0f')} / {fmt(p['step_ms_median_second_half'], '.0f')} |"
        )
    md += [
        "",
        "Seconds per step by phase, up to L* (the whole run where L* was not reached): SCAPE's dense steps (the "
        "warm-up and the ramp's steps denser than 1/4) and the steps after them; every step of the DDP methods is "
        "dense. Median ms per step, and seconds in all:",
        "",
        "| method | dense steps | ms/step | s | later steps | ms/step | s |",
        "|---|---|---|---|---|---|---|",
        *(phase_row(p) for p in per.values()),
    ]
    md += ["", sizing_line(prof), "", *scape_config_lines(per), ""]
    return md


def parse_link_changes(spec: str) -> list[tuple[float, float]]:
    """``"100@240,1000@600"`` -> ``[(240.0, 100.0), (600.0, 1000.0)]``: (seconds after the workers start, Mbit/s)."""
    changes = []
    for part in filter(None, spec.split(",")):
        mbit, _, seconds = part.partition("@")
        try:
            changes.append((float(seconds), float(mbit)))
        except ValueError:
            raise SystemExit(f"--link-change {part!r}: write MBIT@SECONDS, e.g. 100@240") from None
    return sorted(changes)


def phase_row(p: dict[str, Any]) -> str:
    """One method's steps up to L*, split into the dense steps and the ones after them."""
    cum = p["cum_time_s"]
    reached = p["to_1.00_steps"]
    end = int(reached) if math.isfinite(reached) else len(cum)
    cfg = p.get("config")
    if p.get("decisions"):  # SCAPE chose its form: the dense steps it measured on before its first decision
        dense = min(end, p["decisions"][0]["step"])
    else:
        dense = min(end, ScapeConfig.from_dict(cfg).dense_steps) if cfg else end
    times = [b - a for a, b in zip([0.0, *cum[: end - 1]], cum[:end], strict=True)]
    cells = [p["label"]]
    for part in (times[:dense], times[dense:]):
        med = f"{1000 * statistics.median(part):.0f}" if part else "-"
        cells += [str(len(part)), med, f"{sum(part):.1f}" if part else "-"]
    return "| " + " | ".join(cells) + " |"


def _budget(facts: dict[str, Any], short: bool = False) -> str:
    """The step budgets: ``steps``, and SCAPE's where it differs."""
    steps, scape = facts["steps"], facts.get("scape_steps", facts["steps"])
    if scape == steps:
        return f"{steps}" if short else f"{steps} steps"
    return f"{steps}; SCAPE {scape}" if short else f"{steps} steps ({scape} for SCAPE, over its own cosine)"


def sizing_line(prof: dict[str, Any]) -> str:
    """How long a round and an evaluation took, and the step budget that would fill an hour at that pace."""
    s = prof["summary"]
    rnd, ev, n_ev = s.get("round_s_mean", math.nan), s.get("eval_round_s_mean", math.nan), s.get("evaluations", 0)
    setup = s.get("setup_s", math.nan)
    if not rnd or math.isnan(rnd):
        return "Sizing: no round times recorded."
    evals_per_step = n_ev / max(1, prof["steps"], prof.get("scape_steps", 0))
    fit = (3600.0 - (setup if not math.isnan(setup) else 0.0)) / (rnd + evals_per_step * ev)
    return (
        f"Sizing: a round (one step of every method still training, barriers included) took {rnd:.2f} s on average "
        f"(median {s['round_s_median']:.2f} s), an evaluation of the methods due {fmt(ev, '.1f')} s ({n_ev} of them), "
        f"the workers' set-up {fmt(setup, '.0f')} s: at this pace an hour holds about {fit:.0f} steps with "
        f"validation as often."
    )


def scape_config_lines(per: dict[str, dict[str, Any]]) -> list[str]:
    """What the SCAPE rows ran with (the package's defaults at run time) and PowerSGD's vanilla phase."""
    lines = []
    fields = (
        *("density", "dense_warmup_steps", "density_ramp_steps"),
        *("catch_up_cap", "exploration", "chunk_size", "sharded", "wire_format"),
    )
    for p in per.values():
        cfg = p.get("config")
        if cfg:
            lines.append(f"- {p['label']}: " + ", ".join(f"{k}={cfg[k]}" for k in fields if k in cfg))
        if p.get("powersgd"):
            ps = p["powersgd"]
            lines.append(
                f"- {p['label']}: rank {ps['rank']}, vanilla all-reduce for the first {ps['start_powerSGD_iter']} steps"
            )
    return (["Configurations:", "", *lines]) if lines else []


HEADLINE_METHODS: tuple[str, ...] = (
    "scape_default_d0.01",
    "scape_default_int8_d0.01",
    "scape_default_int8_d0.025",
    "scape_int8_dense",
    "scape_default_d0.1",
    "scape_default_gradient_d0.01",
    "ddp_powersgd",
    "ddp_bf16",
    "ddp_adams",
)


def headline_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The README's table: per (W, model, link), each method's time to DDP + AdamW's final loss, x DDP's time."""
    present = [m for m in HEADLINE_METHODS if any(m in p["summary"]["per_method"] for r in runs for p in r["profiles"])]
    md = [
        "| link | W, model (steps) | DDP + AdamW: final val loss L*, s | "
        + " | ".join(f"{METHOD_LABELS.get(m, m)}: time to L*" for m in present)
        + " | fastest to L* |",
        "|---|---|---|" + "---|" * len(present) + "---|",
    ]
    for r in runs:
        for prof in r["profiles"]:
            s = prof["summary"]
            per = s["per_method"]
            ddp = per[DDP]
            cells = [
                prof["profile"] if r["emulated"] else "loopback, NO LIMIT",
                f"{r['world_size']}, {r['model']} ({_budget(_run_facts(r), short=True)})"
                + (f", seed {r['seed']}" if r.get("seed", 0) else ""),
                f"{ddp['final_val_loss']:.3f}, {_secs(ddp['total_s'])} s",
            ]
            for m in present:
                cells.append(_time_cell(per[m], 1.0, short=True) if m in per else "n/a")
            reached = {n: p["to_1.00_time_s"] for n, p in per.items() if p["to_1.00_reached"]}
            best = min(reached, key=lambda n: reached[n]) if reached else None
            cells.append("none" if best is None else per[best]["label"])
            md.append("| " + " | ".join(cells) + " |")
    return md


def write_report(runs: Sequence[dict[str, Any]], out: str, merged: bool = False) -> None:
    """``results.md``, ``headline.md``, ``results.csv``, ``curves.csv`` and the plots of one or more runs.

    Args:
        runs: ``results.json`` contents.
        out: The folder to write to.
        merged: A report over several runs (``--report``): plots go to ``w<W>_<model>_<profile>/``.
    """
    md = ["# Time to DDP + AdamW's validation loss", ""]
    for r in runs:
        md += [
            f"Network: **{network_mode(r)}**. Command: `{r['command']}`",
            f"Machine: {machine_line(r)}.",
            f"Model: litgpt GPT preset `{r['model']}` ({r['params'] / 1e6:.2f}M parameters), W = {r['world_size']}, "
            f"{r['batch_size']} x {r['block_size']} tokens per rank per step, {r['steps']} steps, cosine LR peak "
            f"{r['lr']} ({r['lr_warmup']} ramp steps, 0 at the last step), validation every {r['eval_every']} steps "
            f"on {r['eval_batches']} x 16 windows of the `{r['corpus']}` corpus's validation split.",
            "",
        ]
        for prof in r["profiles"]:
            md += profile_tables({**prof, **_run_facts(r)}, r["emulated"])
    md += ["# Headline", "", *headline_table(runs), ""]
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write("\n".join(md))
    with open(os.path.join(out, "headline.md"), "w") as fh:
        fh.write("\n".join(headline_markdown(runs)) + "\n")
    rows: list[dict[str, Any]] = []
    curve_rows: list[dict[str, Any]] = []
    for r in runs:
        for prof in r["profiles"]:
            for p in prof["summary"]["per_method"].values():
                base = {
                    "network": network_column(r["emulated"]),
                    "profile": prof["profile"],
                    "rate_mbit": prof["rate_mbit"],
                    "world_size": r["world_size"],
                    "model": r["model"],
                }
                scalars = {
                    k: v
                    for k, v in p.items()
                    if k not in ("points", "train_loss", "cum_time_s", "config", "powersgd") and not isinstance(v, list)
                }
                rows.append({**base, **scalars})
                for q in p["points"]:
                    curve_rows.append({**base, "method": p["method"], **q})
    for name, data in (("results.csv", rows), ("curves.csv", curve_rows)):
        write_csv(os.path.join(out, name), data)
    plot(runs, out, merged)


def _run_facts(r: dict[str, Any]) -> dict[str, Any]:
    facts = {k: r[k] for k in ("world_size", "model", "steps", "batch_size", "block_size", "eval_every")}
    return {**facts, "scape_steps": r.get("scape_steps", r["steps"]), "seed": r.get("seed", 0)}


def headline_markdown(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The README snippet: the table, what it measures, the commands and the machine."""
    loop = any(not r["emulated"] for r in runs)
    md = [
        "Wall-clock to reach DDP + AdamW's final validation loss L* (after its step budget), as seconds of "
        "step time and a multiple of DDP + AdamW's own time to L* (not reached: the gap of the method's best "
        "validation loss to L*); every method trained the same model from "
        "the same weights on the same batches, in lock-step rounds on one machine, each rank in its own network "
        "namespace behind a rate-limited link (`docs/benchmarks.md`, section Time to loss)."
        + (" **Some rows ran on LOOPBACK without any rate limit: not a network measurement.**" if loop else ""),
        "",
        *headline_table(runs),
        "",
        # Inline code, not a ```bash block: the README's bash blocks are its set-up commands (tests/test_readme.py).
        "Commands (as root, one per row's profile):",
        "",
        *[f"- `{r['command']}`" for r in runs],
        "",
        "Machine: " + "; ".join(sorted({machine_line(r).split("; load")[0] for r in runs})) + ".",
    ]
    return md


def plot(runs: Sequence[dict[str, Any]], out: str, merged: bool = False) -> None:
    """Per profile: validation loss against wall-clock and against step, with the two target lines."""
    plt = pyplot()
    if plt is None:
        return
    for r in runs:
        tag = "" if r["emulated"] else " [LOOPBACK, no rate limit]"
        for prof in r["profiles"]:
            s = prof["summary"]
            folder = os.path.join(out, prof_dir_name(r, prof["profile"], merged))
            os.makedirs(folder, exist_ok=True)
            for kind, xlabel in (("time", "wall-clock s (sum of step times)"), ("step", "step")):
                fig, ax = plt.subplots(figsize=(8, 5))
                for p in s["per_method"].values():
                    pts = p["points"]
                    x = [q["time_s"] if kind == "time" else q["step"] for q in pts]
                    ax.plot(
                        x,
                        [q["loss"] for q in pts],
                        marker=".",
                        label=p["label"],
                        **method_style(p["method"], (*TTL_METHODS, *TTL_FSDP_METHODS)),
                    )
                    mark_decisions(ax, p, kind)
                for f, ls in zip(TARGET_FACTORS, (":", "-."), strict=True):
                    ax.axhline(s["targets"][str(f)], color="grey", linestyle=ls, linewidth=0.8, label=f"{f:g} L*")
                ax.set_xlabel(xlabel)
                ax.set_ylabel("validation loss (nats/byte)")
                ax.set_title(f"{prof['profile']}, W={r['world_size']}, {r['model']}: validation loss{tag}")
                lo = min(s["targets"]["1.0"], *(p["min_val_loss"] for p in s["per_method"].values()))
                first = max(p["points"][0]["loss"] for p in s["per_method"].values())
                ax.set_ylim(lo - 0.05 * (first - lo), lo + 0.4 * (first - lo))  # the part where curves separate
                ax.legend(fontsize=7)
                fig.tight_layout()
                fig.savefig(os.path.join(folder, f"val_loss_vs_{kind}.png"), dpi=110)
                plt.close(fig)


def mark_decisions(ax: Any, p: dict[str, Any], kind: str) -> None:
    """Where SCAPE chose its form: a dotted line at each switch, labelled with the form it switched to."""
    cum = p.get("cum_time_s") or []
    for d in p.get("decisions") or []:
        if d["chosen"] == d["before"] or d["step"] > len(cum):
            continue
        x = cum[d["step"] - 1] if kind == "time" else d["step"]
        ax.axvline(x, color="black", linestyle=":", linewidth=0.7)
        ax.text(x, 0.98, f" {d['chosen']}", transform=ax.get_xaxis_transform(), fontsize=6, va="top", rotation=90)


def prof_dir_name(r: dict[str, Any], profile: str, merged: bool) -> str:
    """The folder of a profile's plots: the profile's own (with its records) in a run's output, and
    ``w<W>_<model>_<profile>`` in a report that merges runs (two runs may share a profile)."""
    return f"w{r['world_size']}_{r['model']}_{profile}" if merged else profile


# -------------------------------------------------------------------------------------------- the command


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.network.time_to_loss",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--profile", default="100mbit", help=f"comma list of {[*PROFILES, 'unlimited']} or rates, or 'all'")
    ap.add_argument("--methods", default="all", help=f"comma list of 'all' and of {list(TTL_METHODS)}")
    ap.add_argument("--model", default="small", choices=list(MODEL_PRESETS), help="model preset")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (hosts)")
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help=f"ranks sharing one host's unshaped namespace; {list(TTL_FSDP_METHODS)} shard the model over them",
    )
    ap.add_argument(
        "--steps",
        default="auto",
        help=f"step budget of every method; 'auto': (steps, SCAPE's steps, eval every) of {BUDGETS}",
    )
    ap.add_argument(
        "--scape-steps",
        type=int,
        default=0,
        help="step budget of every SCAPE method, over its own cosine (0: --steps); cheaper steps buy more of them",
    )
    ap.add_argument("--eval-every", type=int, default=0, help=f"validate every N steps (0: steps / {EVAL_POINTS})")
    ap.add_argument("--eval-batches", type=int, default=EVAL_BATCHES, help="validation batches of 16 windows")
    ap.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per rank per step")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=PEAK_LR, help="peak learning rate (all methods)")
    ap.add_argument("--lr-warmup", type=int, default=LR_WARMUP, help="LR ramp steps (and PowerSGD's vanilla phase)")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order (the same for every method)")
    ap.add_argument("--corpus", default="stdlib", choices=["stdlib", "prose"], help="text (split by file)")
    ap.add_argument("--max-bytes", type=int, default=0, help="bytes of the corpus to read (0: all of it)")
    ap.add_argument("--chunk-size", type=int, default=0, help="SCAPE chunk size (0: the package default)")
    ap.add_argument(
        "--scape-set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set a ScapeConfig field on every SCAPE method (smoke tests; the published runs set none)",
    )
    ap.add_argument("--loopback", action="store_true", help="no namespaces, no limit (also without root)")
    ap.add_argument("--timeout-s", type=float, default=2 * 3600.0, help="give up on a profile after this long")
    ap.add_argument(
        "--link-change",
        default="",
        help="change the link during the run: comma list of MBIT@SECONDS (after the workers start), e.g. 100@240",
    )
    ap.add_argument("--out", default=None, help="output directory (default: a new temporary one)")
    ap.add_argument("--resummarize", metavar="OUT", default=None, help="only rebuild OUT's outputs from its records")
    ap.add_argument(
        "--report", nargs="+", metavar="RUN", default=None, help="merge finished runs' results.json into --out"
    )
    ns = ap.parse_args(argv)
    if ns.report or ns.resummarize:
        return ns
    if ns.steps == "auto":
        key = (ns.model, ns.world_size)
        if key not in BUDGETS:
            ap.error(
                f"no sized budget for --model {ns.model} --world-size {ns.world_size} ({list(BUDGETS)}); give --steps N"
            )
        ns.steps, auto_scape, auto_eval = BUDGETS[key]
        ns.scape_steps = ns.scape_steps or auto_scape
        ns.eval_every = ns.eval_every or auto_eval
    else:
        try:
            ns.steps = int(ns.steps)
        except ValueError:
            ap.error(f"--steps must be a number or 'auto', got {ns.steps!r}")
    if ns.steps < 1 or ns.world_size < 2 or ns.eval_every < 0 or ns.eval_batches < 1 or ns.scape_steps < 0:
        ap.error("--steps must be >= 1, --scape-steps >= 0, --world-size >= 2, --eval-every >= 0, --eval-batches >= 1")
    if ns.ranks_per_host < 1 or ns.world_size % ns.ranks_per_host:
        ap.error(f"--ranks-per-host {ns.ranks_per_host} must divide --world-size {ns.world_size}")
    if ns.ranks_per_host > 1 and ns.eval_batches % ns.world_size:
        # A sharded model's forward is a collective of its shard group: every rank must evaluate as many batches.
        ap.error(f"--eval-batches {ns.eval_batches} must be a multiple of --world-size {ns.world_size} with hosts")
    ns.scape_steps = ns.scape_steps or ns.steps
    ns.eval_every = ns.eval_every or max(1, round(ns.steps / EVAL_POINTS))
    ns.scape_overrides = parse_scape_set(ns.scape_set, ap)
    return ns


def parse_scape_set(items: list[str], ap: argparse.ArgumentParser) -> dict[str, Any]:
    """``--scape-set FIELD=VALUE`` items as ScapeConfig changes (values parsed as JSON, else kept as text)."""
    fields = ScapeConfig().to_dict()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            ap.error(f"--scape-set {item!r}: write FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    try:
        ScapeConfig(**out)
    except (TypeError, ValueError) as e:
        ap.error(f"--scape-set: {e}")
    return out


def select_methods(spec: str) -> list[str]:
    """The methods of ``--methods`` in table order; DDP + AdamW, the reference, always among them."""
    known = (*TTL_METHODS, *TTL_FSDP_METHODS)
    names: list[str] = []
    for m in (m.strip() for m in spec.split(",") if m.strip()):
        for name in TTL_METHODS if m == "all" else (m,):
            if name not in known:
                raise SystemExit(f"unknown method {name!r}; choose from {list(known)} or 'all'.")
            if name not in names:
                names.append(name)
    if DDP not in names:
        names.insert(0, DDP)
    return [m for m in known if m in names]


def warn_about_budget(steps: int, methods: list[str], overrides: dict[str, Any], chunk_size: int) -> list[str]:
    """Warnings when a SCAPE method spends much of the budget in its dense warm-up and density ramp."""
    warnings = []
    for name in methods:
        if name not in SCAPE_BUDGET_METHODS:
            continue
        # What the workers will build (the FSDP form takes ScapeStrategy's configuration).
        cfg = ttl_scape_config(name.replace("scape_fsdp_", "scape_"), chunk_size, overrides)
        dense = cfg.dense_warmup_steps + cfg.density_ramp_steps
        if dense >= steps:
            warnings.append(
                f"WARNING: {name}: dense warm-up + density ramp ({cfg.dense_warmup_steps} + {cfg.density_ramp_steps} "
                f"steps, the package defaults) cover the whole budget of {steps} steps: it never runs sparse."
            )
        elif dense > 0.25 * steps:
            warnings.append(
                f"note: {name}: dense warm-up + density ramp are {dense} of the {steps} steps ({dense / steps:.0%})."
            )
    return warnings


def resummarize(out: str) -> dict[str, Any]:
    """Rebuild every output of ``out`` from its per-rank records (after a change to the statistics)."""
    results = harness.resummarize(out, lambda ranks, r: summarize_ttl(ranks, r["methods"], r["emulated"]))
    write_json(results, out)
    write_report([results], out)
    return results


def report(run_dirs: list[str], out: str) -> list[dict[str, Any]]:
    """Merge finished runs (their ``results.json``) into one ``results.md``, ``headline.md``, CSVs and plots.

    Raises:
        SystemExit: A folder holds no ``results.json`` (the run did not finish a profile).
    """
    runs = []
    for d in run_dirs:
        path = os.path.join(d, "results.json")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} does not exist: is {d} the --out of a finished time-to-loss run?")
        with open(path) as fh:
            runs.append(json.load(fh))
    os.makedirs(out, exist_ok=True)
    write_report(runs, out, merged=True)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the time-to-loss benchmark; returns everything written to ``results.json``."""
    args = parse_args(argv)
    if args.report:
        out = args.out or tempfile.mkdtemp(prefix="ttl-report-")
        report(args.report, out)
        print(f"wrote {out}/results.md, headline.md, results.csv, curves.csv and plots")
        return {"report": args.report, "out": out}
    if args.resummarize:
        rebuilt = resummarize(args.resummarize)
        print(f"rewrote {args.resummarize}/results.md, headline.md, CSVs, results.json and plots")
        return rebuilt
    methods = select_methods(args.methods)
    profiles = harness.select_profiles(args.profile)
    out = args.out or tempfile.mkdtemp(prefix="ttl-")
    os.makedirs(out, exist_ok=True)
    for w in warn_about_budget(args.scape_steps, methods, args.scape_overrides, args.chunk_size):
        print(w, flush=True)
    profiles, reason = harness.emulation(args.loopback, profiles)
    results: dict[str, Any] = {
        "mode": "time_to_loss",
        **harness.results_header("benchmarks.network.time_to_loss", argv, args, reason),
        "scape_steps": args.scape_steps,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "lr": args.lr,
        "lr_warmup": args.lr_warmup,
        "corpus": args.corpus,
        "seed": args.seed,
        "max_bytes": args.max_bytes,
        "scape_defaults": ScapeConfig().to_dict(),
        "scape_overrides": args.scape_overrides,
        "methods": methods,
        "profiles": [],
    }

    def spec_for(h: Host, prof_dir: str) -> WorkerSpec:
        return WorkerSpec.for_host(
            args,
            methods,
            prof_dir,
            h.ifname,
            warmup=args.lr_warmup,
            timeout_s=min(args.timeout_s, 1800.0),
            schedule="cosine",
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            corpus=args.corpus,
            seed=args.seed,
            scape_overrides=args.scape_overrides,
            method_steps={m: args.scape_steps for m in methods if m in SCAPE_BUDGET_METHODS},
            shard_size=args.ranks_per_host,
        )

    def write(r: dict[str, Any]) -> None:
        write_json(r, out)
        write_report([r], out)

    harness.measure_profiles(
        results,
        profiles,
        out,
        announce=f"{args.world_size} ranks, {len(methods)} methods, {args.steps} steps (SCAPE {args.scape_steps}), "
        f"validation every {args.eval_every}",
        spec_for=spec_for,
        timeout_s=args.timeout_s,
        summarize=lambda ranks: summarize_ttl(ranks, methods, reason is None),
        show=lambda prof: print("\n".join(profile_tables({**prof, **_run_facts(results)}, reason is None))),
        write=write,
        rate_changes=parse_link_changes(args.link_change),
    )
    print(f"wrote {out}/results.md, headline.md, results.csv, curves.csv, results.json and plots")
    return results


if __name__ == "__main__":
    main()
