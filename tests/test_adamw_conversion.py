"""``benchmarks/adamw_conversion.py``: what it plans, the update sizes it reports, and a tiny run of each part.

The update sizes are hand-worked: Adam's first step moves every coordinate by the learning rate (``m / sqrt(v)``
is ``g / |g|``), AdamS's too since its normaliser is bias-corrected, and the previous rule by ``lr / sqrt(1 - b2)``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks import adamw_conversion as conv

# A 784-512-256-10 MLP on 64 images: a step takes milliseconds.
TINY_STEPS = 4


def test_the_plan_covers_the_grid_and_leaves_the_transformer_out_of_it() -> None:
    grid = conv.planned("optimizer", ["cnn", "transformer"], [0])
    per_workload = len(conv.BETA2S) * 2 * len(conv.LRS) * len(conv.OPTIMIZERS)  # 2: without and with a warm-up
    assert len(grid) == per_workload and {r.workload for r in grid} == {"cnn"}
    assert {(r.lr, r.warmup > 0) for r in grid} == {(lr, w) for lr in conv.LRS for w in (False, True)}
    scape = conv.planned("scape", ["transformer"], [0, 1])
    assert len(scape) == 2 * len(conv.BETA2S) * len(conv.SCHEDULES) * len(conv.SCAPE_METHODS)
    assert len({r.key for r in scape}) == len(scape)


@pytest.mark.parametrize("b2", [0.999, 0.95])
def test_first_steps_move_as_adam_except_under_the_previous_rule(b2: float) -> None:
    sizes = {}
    for opt in conv.OPTIMIZERS:
        rec = conv.run_one(conv.Run("steps", "mlp", opt, b2, 1e-3, 0, 2))
        sizes[opt] = rec["update"]
    # Step 1: every coordinate with a gradient moves by lr (coordinates of dead ReLUs do not move: the p99 is 1).
    assert sizes["adamw"][0]["p99"] == pytest.approx(1.0, rel=1e-3)
    assert sizes["adams"][0]["p99"] == pytest.approx(1.0, rel=1e-3)
    assert sizes["adams_previous"][0]["p99"] == pytest.approx(1.0 / math.sqrt(1.0 - b2), rel=1e-3)
    # Steps 1 and 2 of the converted AdamW are AdamW's (the same weights, batches and dropout).
    for step in (0, 1):
        assert sizes["adams"][step]["rms"] == pytest.approx(sizes["adamw"][step]["rms"], rel=1e-4)


def test_a_tiny_run_of_each_part_writes_the_report(tmp_path: Path) -> None:
    done = {}
    runs = [
        conv.Run("optimizer", "mlp", "adams", 0.999, 1e-3, 1, TINY_STEPS),
        conv.Run("steps", "mlp", "adamw", 0.95, 1e-3, 0, TINY_STEPS),
        *(conv.Run("scape", "mlp", m, 0.95, 1e-3, 0, TINY_STEPS, 0, "cosine") for m in conv.SCAPE_METHODS),
    ]
    for run in runs:
        rec = conv.run_one(run)
        assert len(rec["train_loss"]) == TINY_STEPS and all(math.isfinite(x) for x in rec["train_loss"])
        assert rec["curve"][-1]["step"] == TINY_STEPS and 0.0 <= rec["curve"][-1]["accuracy"] <= 1.0
        done[run.key] = rec
    text = conv.write_report(str(tmp_path), done)
    assert "### mlp: held-out loss" in text and "### Update size" in text and "### Under SCAPE" in text
    header, *rows = (tmp_path / "curves.csv").read_text().splitlines()
    assert header.startswith("part,workload,method") and len(rows) == sum(len(r["curve"]) for r in done.values())
