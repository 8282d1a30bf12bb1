"""``lightning-scape pretrain --resume`` on another number of processes than the run that wrote the checkpoint."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import rank_file_names

REPO = Path(__file__).resolve().parent.parent
DEBUG = str(REPO / "recipes" / "debug.yaml")
STEPS, SAVE_AT = 16, 8  # optimizer steps of 16 sequences of 128 tokens; checkpoints every 8


def _pretrain(out_dir: Path, cache: Path, *args: str) -> str:
    """The debug recipe (2 processes, 8 sequences each: no accumulation) for 16 steps, or as ``args`` change it."""
    command = [
        sys.executable, "-m", "lightning_scape", "pretrain", "--config", DEBUG, "--out_dir", str(out_dir),
        "--data.max_bytes", "600000", "--train.log_interval", "1", "--train.save_interval", str(SAVE_AT),
        "--eval.max_iters", "2", "--train.max_tokens", str(STEPS * 16 * 128), "--scape.dense_warmup_steps", "4",
        *args,
    ]  # fmt: skip
    env = {**os.environ, "LIGHTNING_SCAPE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, cwd=out_dir.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _metrics(out_dir: Path) -> list[dict[str, str]]:
    (path,) = out_dir.glob("logs/csv/**/metrics.csv")
    with open(path) as fh:
        return [r for r in csv.DictReader(fh) if r.get("loss")]


@pytest.mark.dist
def test_resume_on_one_process_continues_the_two_process_run(tmp_path: Path) -> None:
    """2 processes write step 8; 1 process resumes it (accumulating 2 micro-batches per step, the same global
    batch): litgpt continues at the same step, sample and learning rate, and the SCAPE state is re-sharded."""
    cache = tmp_path / "cache"
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _pretrain(whole, cache)
    log = _pretrain(resumed, cache, "--devices", "1", "--resume", str(whole / f"step-{SAVE_AT:08d}" / "lit_model.pth"))
    assert "resumed a checkpoint of 2 processes on 1" in log and "continues at iteration 16 (was 8" in log
    # One micro-batch per process and step on 2 processes, two on 1: iterations 18, 20, .., 32 end steps 9..16.
    rows = {int(r["iter"]) // 2: r for r in _metrics(resumed)}
    assert sorted(int(r["iter"]) for r in rows.values()) == list(range(2 * SAVE_AT + 2, 2 * STEPS + 1, 2))
    whole_rows = {int(r["iter"]): r for r in _metrics(whole)}
    assert sorted(whole_rows) == list(range(1, STEPS + 1))
    for step, r in rows.items():
        assert int(r["total_tokens"]) == int(whole_rows[step]["total_tokens"])  # as many tokens seen in all
        # litgpt sets the learning rate per micro-batch; the step takes its last micro-batch's, half a step later
        # in the schedule on 1 process than on 2 (not restarted: without the rescale it would be half of it).
        if step < STEPS:
            lr, before, after = (float(x["learning_rate"]) for x in (r, whole_rows[step], whole_rows[step + 1]))
            assert before < lr < after or before > lr > after, (step, before, lr, after)
    # The final checkpoint has one rank file; the losses of the continuation stay with the uninterrupted run's.
    assert rank_file_names(resumed / "final" / "lit_model.pth.scape") == ["rank-00000.pt"]
    mean = sum(float(rows[s]["loss"]) for s in rows) / len(rows)
    mean_whole = sum(float(whole_rows[s]["loss"]) for s in rows) / len(rows)
    print(f"pretrain 2 -> 1: mean loss of steps 9-16 {mean:.4f} (uninterrupted {mean_whole:.4f})")
    assert abs(mean - mean_whole) <= 0.03 * mean_whole
    state = torch.load(resumed / "final" / "lit_model.pth", weights_only=False)
    assert state["step_count"] == STEPS and state["iter_num"] == 2 * STEPS
