"""Risky set-ups refused or named, and a failure on two ranks reported once (``_refusal_worker.py`` runs them).

``bf16-true`` / ``16-true`` and two optimizers refused by both strategies; one process warned that it communicates
nothing; a SCAPE checkpoint's optimizer entry refused by a torch optimizer (``strategy="ddp"``) instead of loading
as empty moments; an unsupported optimizer (both strategies) and a missing ``.scape`` folder on two processes: one
traceback, rank 0's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import HERE, PYTHON, child_env

from lightning_scape.examples.workloads import free_port
from lightning_scape.runtime.checkpoint_protocol import STUB_REFUSAL

pytestmark = pytest.mark.dist


def run_case(case: str, outdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "_refusal_worker.py", case, str(outdir)],
        env=child_env(MASTER_PORT=str(free_port())),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=HERE,
    )


def saved(case: str, outdir: Path) -> dict[str, Any]:
    proc = run_case(case, outdir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = torch.load(outdir / f"{case}.pt")
    return result


def test_16_bit_weights_and_two_optimizers_are_refused_by_both_strategies_and_one_process_named(tmp_path: Path) -> None:
    out = saved("precision", tmp_path)
    for interface in ("trainer", "fabric"):
        for precision, fix in (("bf16-true", "'bf16-mixed'"), ("16-true", "'16-mixed'")):
            error = out[f"{interface} {precision}"]
            assert error is not None and error.startswith("ValueError")
            assert f"precision='{precision}'" in error and fix in error and "residual" in error
    for interface, given in (("trainer", "configure_optimizers returned"), ("fabric", "fabric.setup was given")):
        error = out[f"{interface} two optimizers"]
        assert error is not None and error.startswith("ValueError: ScapeStrategy steps one optimizer per model")
        assert f"{given} 2 (AdamW, Adam)" in error and "param groups of one AdamS / AdamW" in error
    # The Trainer's fit has no LR scheduler (its converted AdamW is told at set-up); Fabric's loop cannot tell.
    (no_scheduler,) = out["no_scheduler"]
    assert "AdamW" in no_scheduler and "CosineAnnealingLR" in no_scheduler
    trainer_warning, fabric_warning = out["one_process"]  # once per strategy, not once per step or set-up
    assert "communicates nothing" in trainer_warning and "Trainer(devices=2" in trainer_warning
    assert "Fabric(devices=2" in fabric_warning and "strategy='auto'" in fabric_warning
    # Runs of one process whose steps are all dense are not told "every step sends the whole gradient": one
    # process sends nothing (the warning above), and a second warning beside it only misleads.
    assert out["dense_warmup"] == []


def test_a_scape_checkpoint_resumed_by_ddp_fails_saying_what_it_is_instead_of_empty_moments(tmp_path: Path) -> None:
    out = saved("ddp_resume", tmp_path)
    assert set(out) == {"trainer AdamW", "trainer Adam", "fabric ddp"}
    for where, error in out.items():
        assert error is not None, f"{where}: the optimizer loaded the stub as an empty state"
        assert STUB_REFUSAL in error and "ScapeStrategy" in error, where


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("sgd", "TypeError: ScapeStrategy steps the optimizer itself"),
        ("fsdp_sgd", "TypeError: ScapeStrategy steps the optimizer itself"),
        ("missing_scape", "FileNotFoundError: SCAPE state of rank 0 is missing"),
    ],
)
def test_a_failure_on_both_ranks_is_reported_once_naming_the_ranks(case: str, cause: str, tmp_path: Path) -> None:
    proc = run_case(case, tmp_path)
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("Traceback (most recent call last)") == 1, err[-6000:]
    assert err.count(cause) == 1 and "failed on ranks 0, 1 of 2" in err, err[-6000:]
    assert "[rank1]" not in err and "Connection reset" not in err
