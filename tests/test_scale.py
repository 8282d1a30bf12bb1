"""``benchmarks/scale.py``: its ``--tiny`` run on the CPU, its sizing, its schedule and its corpus.

The command itself is meant for a GPU (``docs/performance.md``); here it runs at its tiny size, with the
references, which is a test of the code path and not a measurement.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.scale import (
    BASELINE,
    FULL,
    LABELS,
    METHODS,
    MIN_STEPS,
    TIME_SAFETY,
    Probe,
    make_plan,
    method_config,
    predicted_run_s,
    python_sources,
)
from lightning_scape import ScapeConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.dist
def test_tiny_run_trains_every_method_from_the_same_start_and_writes_the_report(tmp_path: Path) -> None:
    pytest.importorskip("litgpt")
    pytest.importorskip("tokenizers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "LIGHTNING_SCAPE_"))}
    out = tmp_path / "scale"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scale",
            "--tiny",
            "--methods",
            ",".join(METHODS),
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    assert list(runs) == list(METHODS) and not results["skipped"]
    assert results["plan"]["steps"] == 12 and results["plan"]["batch"] == 2 and results["plan"]["limit"] == "given"
    # The same initial weights and the same first batch: the first step's loss is the same for every method.
    first = {m: r["train_loss"][0] for m, r in runs.items()}
    assert len(set(first.values())) == 1, first
    for method, rec in runs.items():
        assert len(rec["train_loss"]) == len(rec["step_bytes"]) == 12
        assert rec["train_loss"][-1] < rec["train_loss"][0], method  # every method learns
        assert [c[0] for c in rec["curve"]] == [4, 8, 12]
    # The schedule scaled to 12 steps: one dense warm-up step and a 5-step ramp, then sparse steps.
    assert runs["scape_fp32_d0.01"]["config"]["dense_warmup_steps"] == 1
    assert runs["scape_fp32_d0.01"]["config"]["density_ramp_steps"] == 5
    rows = {r["method"]: r for r in results["summary"]}
    assert rows[BASELINE]["val_vs_ddp_adams"] == 1.0
    for method in ("scape_fp32_d0.01", "scape_int8_d0.025"):
        assert rows[method]["ddp_bytes_over_sent_after_ramp"] > 50  # about 1% of the values, with indices
        assert rows[method]["sent_over_ddp_run"] < 0.5
    # The defaults' pilot read the given 100 Mbit/s link and chose a form on the int8 wire (dense for a model this
    # small, whose bytes cost less than the given compute); the report says which.
    decisions = runs["scape_auto_100mbit"]["decisions"]
    assert decisions and decisions[0][1].startswith("int8"), decisions
    assert rows["scape_auto_100mbit"]["forms"].startswith("int8") and not rows["scape_fp32_d0.01"]["forms"]
    with open(out / "curves.csv") as fh:
        curves = list(csv.DictReader(fh))
    assert len(curves) == len(METHODS) * 3 and {
        "method",
        "step",
        "tokens",
        "val_loss",
        "bytes_sent",
        "ddp_bytes",
    } <= set(curves[0])
    with open(out / "steps.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(METHODS) * 12
    assert (out / "scale.png").stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "No CUDA GPU" in md and "Nothing here is a measurement" in md
    assert all(label in md for label in LABELS.values())
    assert "SCAPE defaults at 100 Mbit/s: the form pilot chose int8" in md


def test_the_schedule_is_the_default_at_1000_steps_and_scales_with_the_run() -> None:
    default = method_config("scape_fp32_d0.01", 1000)
    assert default == ScapeConfig(density=0.01)  # the fixed form of the former defaults
    assert method_config("scape_int8_d0.025", 1000) == ScapeConfig(wire_format="int8", density=0.025)
    long = method_config("scape_fp32_d0.01", 2000)
    assert (long.dense_warmup_steps, long.density_ramp_steps) == (60, 800)
    short = method_config("scape_int8_d0.025", 12)
    assert (short.dense_warmup_steps, short.density_ramp_steps, short.density) == (1, 5, 0.025)
    # DDP + AdamS stays dense whatever the length.
    assert method_config(BASELINE, 12).dense_warmup_steps == method_config(BASELINE, 5000).dense_warmup_steps > 5000


def _probe(memory_gb: float | None = 80.0) -> Probe:
    # DDP + AdamS: 40 ms at batch 4, 60 ms at 8 (20 ms fixed, 5 ms a sequence); the sparse steps 4 and 6 ms more;
    # 0.5 GB a sequence (8 GB at batch 4, 10 at 8), the largest peak 10.5 GB at batch 8.
    gb = 1e9
    return Probe(
        batches=(4, 8),
        baseline_step_s=(0.040, 0.060),
        sparse_extra_s={"scape_fp32_d0.01": 0.004, "scape_int8_d0.025": 0.006},
        eval_s=0.3,
        setup_s=3.0,
        peak_bytes={
            f"{BASELINE}@4": int(8 * gb),
            BASELINE: int(10 * gb),
            "scape_fp32_d0.01": int(10.5 * gb),
            "scape_int8_d0.025": int(10.2 * gb),
        },
        device_bytes=int(memory_gb * gb) if memory_gb else None,
    )


def test_the_plan_takes_the_largest_batch_that_fits_the_time_the_text_and_the_memory() -> None:
    methods = list(METHODS)
    probe = _probe()
    assert probe.step_s(BASELINE, 10, sparse=False) == pytest.approx(0.070)
    assert probe.step_s("scape_fp32_d0.01", 10, sparse=True) == pytest.approx(0.074)
    # Time: the largest batch whose three runs fit TIME_SAFETY of the time left, and one more does not.
    plan = make_plan(probe, FULL, methods, 300.0, 10**9, 1000)
    assert plan.limit == "time" and plan.steps == 1000
    assert sum(plan.predicted_s.values()) <= TIME_SAFETY * 300.0
    assert sum(predicted_run_s(probe, FULL, m, 1000, plan.batch + 1) for m in methods) > TIME_SAFETY * 300.0
    # Text: at most max_epochs passes over it (2 x 16.4M tokens / (1000 steps x 2 ranks x 1024) = 16 sequences).
    plan = make_plan(probe, FULL, methods, 3000.0, 16_400_000, 1000)
    assert (plan.limit, plan.batch) == ("epochs", 16)
    # Memory: 10.5 - 8 x 0.5 = 6.5 GB fixed, 0.5 GB a sequence, 90% of 20 GB usable: 23 sequences.
    plan = make_plan(_probe(memory_gb=20.0), FULL, methods, 3000.0, 10**9, 1000)
    assert (plan.limit, plan.batch) == ("memory", 23)
    assert make_plan(probe, FULL, methods, 3000.0, 10**9, 1000).limit == "max_batch"


def test_the_plan_shortens_the_run_rather_than_overrun_and_refuses_below_min_steps() -> None:
    methods = list(METHODS)
    plan = make_plan(_probe(), FULL, methods, 120.0, 10**9, 1000)
    assert plan.batch == 1 and MIN_STEPS <= plan.steps < 1000 and plan.limit == "time"
    assert sum(plan.predicted_s.values()) <= TIME_SAFETY * 120.0
    with pytest.raises(SystemExit, match="not enough time"):
        make_plan(_probe(), FULL, methods, 20.0, 10**9, 1000)


def test_python_sources_copies_whole_py_files_once_and_samples_them_by_path(tmp_path: Path) -> None:
    root = tmp_path / "lib"
    for rel, size in [("a.py", 300), ("pkg/b.py", 300), ("pkg/c.py", 300), ("pkg/tests/t.py", 300),
                      (".hidden/h.py", 300), ("pkg/data.json", 300), ("z.py", 300)]:  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n" * (size // 6))
    cache = tmp_path / "cache"
    everything = python_sources(None, cache, roots={"lib": root})
    files = sorted(p.relative_to(everything).as_posix() for p in everything.rglob("*") if p.is_file())
    # .py files only; tests and hidden folders left out; the manifest is hidden from TextFolder.
    assert files == [".manifest.json", "lib/a.py", "lib/pkg/b.py", "lib/pkg/c.py", "lib/z.py"]
    assert python_sources(None, cache, roots={"lib": root}) == everything  # built once, then reused
    sample = python_sources(700, cache, roots={"lib": root})
    kept = sorted(p.name for p in sample.rglob("*.py"))
    assert len(kept) == 2 and sum(p.stat().st_size for p in sample.rglob("*.py")) <= 700
    assert python_sources(700, cache, roots={"lib": root}) == sample  # the same files every time


def test_gpu_check_gives_the_scale_run_what_is_left_of_the_total_budget() -> None:
    cmd = gpu_check.scale_command("out/g", tiny=False, elapsed_s=330.0, total_s=780.0)
    assert cmd is not None and cmd[1:] == ["-m", "benchmarks.scale", "--out", os.path.join("out/g", "scale"),
                                           "--budget-s", "450"]  # fmt: skip
    # Never more than the scale run's own 8 minutes; nothing when too little is left; --tiny has no budget.
    assert gpu_check.scale_command("o", tiny=False, elapsed_s=60.0, total_s=780.0)[-1] == "480"  # type: ignore[index]
    assert gpu_check.scale_command("o", tiny=False, elapsed_s=700.0, total_s=780.0) is None
    assert gpu_check.scale_command("o", tiny=True, elapsed_s=700.0, total_s=780.0)[-1] == "--tiny"  # type: ignore[index]
