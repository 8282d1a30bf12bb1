"""The time-to-loss mode of the network benchmark (``benchmarks/network/time_to_loss.py``).

The arithmetic (time to a target loss, loss at a given wall-clock, the ratios and bytes of the summary) is
checked on hand-made curves whose answers are worked out in the comments; the whole command runs once on
loopback (no root, no namespaces) with the tiny model for a few steps. The hour-long profiles are
commands (``docs/benchmarks.md``), not tests.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.network.time_to_loss import (
    BUDGETS,
    SCAPE_BUDGET_METHODS,
    CurvePoint,
    loss_at_time,
    parse_args,
    select_methods,
    summarize_ttl,
    time_to_target,
)
from benchmarks.network.worker import TTL_METHODS, TTL_SCAPE_METHODS, ttl_scape_config
from lightning_scape import ScapeConfig

REPO = Path(__file__).resolve().parents[1]  # the benchmarks run as modules from here
# The smoke run's methods: every DDP form, and SCAPE's fp32 wire, sparse int8 wire and int8 wire with every step
# dense (the other SCAPE methods change only a density or the mask statistic).
SMOKE_METHODS = (
    "ddp_adamw",
    "ddp_adams",
    "ddp_bf16",
    "ddp_powersgd",
    "scape_default_d0.01",
    "scape_default_int8_d0.025",
    "scape_int8_dense",
)

# Three evaluations: loss 5 at 0 s, 3 at 5 s (step 2), 2 at 9 s (step 4); 10 bytes per step, 12 on the wire.
CURVE = [
    CurvePoint(0, 0.0, 5.0, 0.0, 0.0),
    CurvePoint(2, 5.0, 3.0, 20.0, 24.0),
    CurvePoint(4, 9.0, 2.0, 40.0, 48.0),
]


def test_time_to_target_interpolates_between_evaluations() -> None:
    """2.1 lies 0.9 of the way from 3 to 2: at 5 + 0.9 x 4 s, step 3.8, 38 bytes, 45.6 on the wire."""
    c = time_to_target(CURVE, 2.1)
    assert c is not None
    assert c.time_s == pytest.approx(8.6)
    assert c.step == pytest.approx(3.8)
    assert c.sent_bytes == pytest.approx(38.0)
    assert c.tx_bytes == pytest.approx(45.6)


def test_time_to_target_exact_hit_first_point_and_not_reached() -> None:
    """A target equal to an evaluation is reached there; one above the first loss at 0 s; one below all never."""
    hit = time_to_target(CURVE, 2.0)
    assert hit is not None and hit.time_s == pytest.approx(9.0) and hit.step == pytest.approx(4.0)
    start = time_to_target(CURVE, 6.0)
    assert start is not None and start.time_s == 0.0 and start.step == 0.0
    assert time_to_target(CURVE, 1.99) is None


def test_time_to_target_takes_the_first_crossing() -> None:
    """A curve that dips to 1.8 at 4 s and comes back up to 2.5 has reached 2.0 on its way down."""
    curve = [CurvePoint(0, 0.0, 3.0), CurvePoint(1, 2.0, 2.2), CurvePoint(2, 4.0, 1.8), CurvePoint(3, 6.0, 2.5)]
    c = time_to_target(curve, 2.0)
    assert c is not None and c.time_s == pytest.approx(3.0)  # half-way from 2.2 (2 s) to 1.8 (4 s)


def test_loss_at_time_interpolates_and_flags_finished_runs() -> None:
    """4 s is 0.8 of the first segment (5 -> 3): 3.4; the last point exactly: not finished; beyond: finished."""
    assert loss_at_time(CURVE, 4.0) == (pytest.approx(3.4), False)
    assert loss_at_time(CURVE, 0.0) == (5.0, False)
    assert loss_at_time(CURVE, 9.0) == (2.0, False)
    assert loss_at_time(CURVE, 20.0) == (2.0, True)
    with pytest.raises(ValueError, match="before the first evaluation"):
        loss_at_time(CURVE, -1.0)


def test_curves_must_be_ordered_and_non_empty() -> None:
    """Out-of-order or empty curves are errors that say what was wrong."""
    with pytest.raises(ValueError, match="out of order"):
        time_to_target([CurvePoint(2, 1.0, 3.0), CurvePoint(1, 2.0, 2.0)], 2.5)
    with pytest.raises(ValueError, match="at least one evaluation"):
        time_to_target([], 1.0)


def _record(step_s: list[float], val: list[float], val_step: list[int], sent: int, tx: int) -> dict[str, Any]:
    n = len(step_s)
    return {
        "loss": [4.0] * n,
        "step_s": step_s,
        "sent": [sent] * n,
        "tx": [tx] * n,
        "val_step": val_step,
        "val_loss": val,
        "eval_s": [0.5] * len(val),
    }


def test_summary_on_hand_made_records() -> None:
    """Two ranks, two methods; every number below is worked out by hand.

    DDP + AdamW: rank 1's second step takes 3 s, so the steps (slowest rank) are 2, 3, 2, 2 s: the curve
    above. Its final loss 2.0 is L*, 1.05 L* = 2.1, reached at 8.6 s (step 3.8).
    SCAPE: 1 s steps, losses 5, 2.5, 2.05 at steps 0, 2, 4: it never reaches 2.0; it reaches 2.1 at
    (2.5 - 2.1) / 0.45 = 8/9 of the second segment: 2 + 16/9 s = 3.778 s, step 3.778, which is 0.439x
    DDP's time = 0.994x its steps x 0.442x its seconds per step.
    """
    ddp0 = _record([2.0, 2.0, 2.0, 2.0], [5.0, 3.0, 2.0], [0, 2, 4], 10, 12)
    ddp1 = _record([2.0, 3.0, 2.0, 2.0], [5.0, 3.0, 2.0], [0, 2, 4], 10, 12)
    sc = _record([1.0, 1.0, 1.0, 1.0], [5.0, 2.5, 2.05], [0, 2, 4], 1, 2)
    ranks = [{"methods": {"ddp_adamw": ddp0, "scape_default_d0.01": sc}} for _ in range(2)]
    ranks[1]["methods"]["ddp_adamw"] = ddp1
    s = summarize_ttl(ranks, ["ddp_adamw", "scape_default_d0.01"], emulated=True)
    assert s["targets"]["1.0"] == 2.0 and s["targets"]["1.05"] == pytest.approx(2.1)
    assert s["ddp_total_s"] == 9.0 and s["fastest_total_s"] == 4.0 and s["fastest_method"] == "scape_default_d0.01"
    ddp, scape = s["per_method"]["ddp_adamw"], s["per_method"]["scape_default_d0.01"]
    assert ddp["to_1.00_reached"] and ddp["to_1.00_time_s"] == pytest.approx(9.0) and ddp["to_1.00_time_vs_ddp"] == 1
    assert ddp["to_1.05_time_s"] == pytest.approx(8.6) and ddp["to_1.05_sent_bytes"] == pytest.approx(38.0)
    assert ddp["to_1.05_tx_bytes"] == pytest.approx(45.6) and ddp["sent_bytes_run"] == 40.0
    assert not scape["to_1.00_reached"] and math.isnan(scape["to_1.00_time_s"])
    assert math.isnan(scape["to_1.00_time_vs_ddp"])
    assert scape["to_1.05_time_s"] == pytest.approx(2 + 16 / 9)
    assert scape["to_1.05_time_vs_ddp"] == pytest.approx((2 + 16 / 9) / 8.6)
    assert scape["to_1.05_steps_vs_ddp"] == pytest.approx((2 + 16 / 9) / 3.8)
    assert scape["to_1.05_step_time_vs_ddp"] == pytest.approx(1 / (8.6 / 3.8))
    assert scape["to_1.05_sent_bytes"] == pytest.approx(2 + 16 / 9)  # 1 byte per step
    # Equal wall-clock: at DDP's 9 s SCAPE had finished (its final 2.05); at SCAPE's 4 s DDP was at 3.4.
    assert (scape["loss_at_ddp_time"], scape["finished_before_at_ddp_time"]) == (2.05, True)
    assert ddp["loss_at_fastest_time"] == pytest.approx(3.4) and not ddp["finished_before_at_fastest_time"]
    # On loopback the interface counters are not the rank's: never reported.
    loop = summarize_ttl(ranks, ["ddp_adamw", "scape_default_d0.01"], emulated=False)
    assert math.isnan(loop["per_method"]["ddp_adamw"]["to_1.05_tx_bytes"])


def test_summary_needs_the_reference() -> None:
    """Without DDP + AdamW there is no target: an error that names it."""
    sc = _record([1.0], [5.0, 4.0], [0, 1], 1, 1)
    with pytest.raises(ValueError, match="ddp_adamw"):
        summarize_ttl([{"methods": {"scape_default_d0.01": sc}}], ["scape_default_d0.01"], emulated=False)


def test_scape_methods_take_the_package_defaults() -> None:
    """Only the density is stated: every other field is ScapeConfig(density=0.01)'s at run time; the
    package's defaults, which choose the form, are a method of their own."""
    assert ttl_scape_config("scape_auto") == ScapeConfig()
    defaults = ScapeConfig(density=0.01).to_dict()
    for name, density in (
        ("scape_default_d0.01", 0.01),
        ("scape_default_d0.1", 0.1),
        ("scape_default_gradient_d0.01", 0.01),  # the statistic is set on the engine (ScapeMethod)
    ):
        assert ttl_scape_config(name).to_dict() == {**defaults, "density": density}, name
    assert ttl_scape_config("scape_default_int8_d0.01").to_dict() == {**defaults, "wire_format": "int8"}
    int8 = {**defaults, "wire_format": "int8", "density": 0.025}
    assert ttl_scape_config("scape_default_int8_d0.025").to_dict() == int8
    # Every step dense: the warm-up outlasts any run, and the method trains DDP's budget, not SCAPE's.
    dense = {**defaults, "wire_format": "int8", "dense_warmup_steps": 10**9}
    assert ttl_scape_config("scape_int8_dense").to_dict() == dense
    assert "scape_int8_dense" not in SCAPE_BUDGET_METHODS
    assert "scape_default_int8_d0.025" in SCAPE_BUDGET_METHODS
    assert ttl_scape_config("scape_default_d0.1", 256, {"dense_warmup_steps": 3}).to_dict() == {
        **defaults,
        "density": 0.1,
        "chunk_size": 256,
        "dense_warmup_steps": 3,
    }
    with pytest.raises(ValueError, match="not ScapeConfig fields"):
        ttl_scape_config("scape_default_d0.01", 0, {"warmup": 3})


def test_command_line_budget_and_methods() -> None:
    """`--steps auto` takes the sized budget; validation 15 times a run; DDP + AdamW is always measured."""
    ns = parse_args(["--model", "small", "--world-size", "2"])
    assert (ns.steps, ns.scape_steps, ns.eval_every) == BUDGETS[("small", 2)]
    ns = parse_args(["--steps", "30", "--eval-every", "10", "--scape-set", "dense_warmup_steps=5"])
    assert (ns.steps, ns.eval_every, ns.scape_overrides) == (30, 10, {"dense_warmup_steps": 5})
    assert ns.scape_steps == 30  # SCAPE's budget is --steps unless given
    assert parse_args(["--steps", "30", "--scape-steps", "45"]).scape_steps == 45
    assert parse_args(["--steps", "300"]).eval_every == 20
    with pytest.raises(SystemExit):
        parse_args(["--model", "base", "--world-size", "2"])  # no sized budget: --steps N is required
    with pytest.raises(SystemExit):
        parse_args(["--steps", "5", "--scape-set", "density=2"])  # ScapeConfig rejects it
    assert select_methods("all") == list(TTL_METHODS)
    assert select_methods("scape_default_d0.01") == ["ddp_adamw", "scape_default_d0.01"]
    # The FSDP forms only when named, after the others; their forward is a collective of the host's ranks, so
    # every rank must evaluate as many validation batches.
    assert select_methods("scape_fsdp_default_d0.01,all")[-1] == "scape_fsdp_default_d0.01"
    assert parse_args(["--steps", "5", "--world-size", "4", "--ranks-per-host", "2"]).ranks_per_host == 2
    for bad in (["--ranks-per-host", "3"], ["--ranks-per-host", "2", "--eval-batches", "6"]):
        with pytest.raises(SystemExit):
            parse_args(["--steps", "5", "--world-size", "4", *bad])


@pytest.mark.dist
def test_time_to_loss_smoke_on_loopback(tmp_path: Path) -> None:
    """Every DDP method and one SCAPE method per code path, 4 steps (SCAPE 6), validation every 2: outputs exist,
    targets computed, plots written, marked loopback."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.network.time_to_loss",
        "--methods",
        ",".join(SMOKE_METHODS),
        "--loopback",
        "--model",
        "tiny",
        "--steps",
        "4",
        "--scape-steps",
        "6",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--batch-size",
        "2",
        "--block-size",
        "32",
        "--lr-warmup",
        "2",
        "--chunk-size",
        "256",
        "--max-bytes",
        "200000",
        "--scape-set",
        "dense_warmup_steps=2",
        "--timeout-s",
        "120",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "LIGHTNING_SCAPE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "running on loopback WITHOUT any rate limit" in proc.stdout

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["emulated"] is False and results["methods"] == list(SMOKE_METHODS)
    s = results["profiles"][0]["summary"]
    per = s["per_method"]
    ddp = per["ddp_adamw"]
    assert [p["step"] for p in ddp["points"]] == [0, 2, 4]
    assert s["targets"]["1.0"] == ddp["final_val_loss"]
    # The reference reaches its own final loss, at the latest at its end.
    assert ddp["to_1.00_reached"] and ddp["to_1.00_time_s"] <= ddp["total_s"] + 1e-9
    # Same initial weights and batch: the first step's training loss is the same for every method.
    first = {round(p["train_loss"][0], 4) for p in per.values()}
    assert len(first) == 1, first
    scape = [m for m in SMOKE_METHODS if m in SCAPE_BUDGET_METHODS]  # SCAPE's budget: all but scape_int8_dense
    for name, p in per.items():
        budget = 6 if name in scape else 4  # --scape-steps: SCAPE trains longer, each method on its own cosine
        assert p["steps"] == budget and p["total_s"] > 0 and p["sent_bytes_run"] > 0, name
        assert [q["step"] for q in p["points"]] == list(range(0, budget + 1, 2)), name
        assert all(math.isfinite(q["loss"]) for q in p["points"]), name
        assert p["to_1.00_reached"] == math.isfinite(p["to_1.00_time_s"]), name
    for name in set(SMOKE_METHODS) & set(TTL_SCAPE_METHODS):
        assert per[name]["config"]["dense_warmup_steps"] == 2  # --scape-set reached the workers
        assert per[name]["config"]["catch_up_cap"] == ScapeConfig().catch_up_cap  # the rest: package defaults
    md = (tmp_path / "results.md").read_text()
    assert "LOOPBACK, NO RATE LIMIT" in md and "Target L*" in md and "Sizing:" in md
    headline = (tmp_path / "headline.md").read_text()
    assert "loopback, NO LIMIT" in headline and "(4; SCAPE 6)" in headline
    assert "```bash" not in headline  # pasted into the README: no bash block beside its set-up commands
    with open(tmp_path / "curves.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 3 * (len(SMOKE_METHODS) - len(scape)) + 4 * len(scape)
    for png in ("loopback/val_loss_vs_time.png", "loopback/val_loss_vs_step.png"):
        assert (tmp_path / png).stat().st_size > 1000, png

    # --report merges finished runs (here one) into another folder.
    rep = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.network.time_to_loss", "--report", str(tmp_path), "--out", str(rep)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (rep / "headline.md").is_file() and (rep / "w2_tiny_loopback" / "val_loss_vs_time.png").is_file()
