"""The README demo end to end, shortened: 2 gloo processes per method, a few steps."""

from __future__ import annotations

import pytest

from lightning_scape.__main__ import main
from lightning_scape.demo import run_demo


@pytest.mark.dist
def test_demo_runs_both_methods_and_scape_sends_far_less(capsys: pytest.CaptureFixture[str]) -> None:
    dense, scape = run_demo(["--steps", "6", "--warmup", "2", "--max-bytes", "300000", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert "dense AdamS" in out and "SCAPE d=0.01" in out and "kB sent/step" in out
    # SCAPE's sparse steps send about (W-1)/W * d N (b_g + b_p + b_i) = 1% * 10/4 of DDP's 2 (W-1)/W N b.
    assert scape["bytes_per_step"] < dense["bytes_per_step"] / 50
    # Dense: one all-reduce of the padded flat buffer, 2 (W-1)/W N b with W = 2, b = 4.
    assert dense["bytes_per_step"] == dense["padded_params"] * 4
    assert dense["dense_equivalent_per_step"] == dense["params"] * 4
    for r in (dense, scape):
        assert 0.0 < r["val_loss"] < 6.0 and r["tokens_per_s"] > 0


def test_cli_usage_and_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0 and "lightning-scape demo" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err
