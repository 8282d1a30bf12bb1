"""``lightning-scape plot``: the demo's plot for a run of one's own, from the metrics CSV a Lightning CSVLogger wrote
(a real Trainer run's CSV: ``test_monitors``)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_scape.examples.run_plot import DDP_KEY, SENT_KEY, read_metrics_csv
from lightning_scape_cli import main

# As a CSVLogger writes them: one row per logging call, the keys not logged in it left empty.
COLUMNS = ["epoch", "step", "train_loss", "val_loss", SENT_KEY, DDP_KEY, "comm/compression_ratio"]


def _write(path: Path, rows: list[dict[str, float]]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _rows() -> list[dict[str, float]]:
    """20 steps: 5 dense (DDP's bytes), then 1/80 of them; a train loss every step, a validation loss every 10."""
    rows: list[dict[str, float]] = []
    for step in range(1, 21):
        sent = 8000.0 if step <= 5 else 100.0
        rows.append({"epoch": 0, "step": step, SENT_KEY: sent, DDP_KEY: 8000.0, "comm/compression_ratio": 8000 / sent})
        rows.append({"epoch": 0, "step": step, "train_loss": 3.0 - 0.1 * step})
        if step % 10 == 0:
            rows.append({"epoch": 0, "step": step, "val_loss": 3.1 - 0.1 * step})
    return rows


def test_a_logged_run_is_plotted_with_ddps_bytes_beside_its_own(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    metrics = tmp_path / "metrics.csv"
    _write(metrics, _rows())
    run, ddp = read_metrics_csv(metrics)
    assert run.sent == (list(range(1, 21)), [8000.0] * 5 + [100.0] * 15)
    assert run.train == (list(range(1, 21)), [3.0 - 0.1 * s for s in range(1, 21)])
    assert run.val == {10: pytest.approx(2.1), 20: pytest.approx(1.1)}
    assert ddp.sent == (list(range(1, 21)), [8000.0] * 20) and not ddp.train[0]
    assert "fewer than DDP" in run.sent_label
    assert main(["plot", str(metrics)]) == 0
    png = tmp_path / "scape.png"
    assert capsys.readouterr().out.strip() == f"plot: {png}"
    assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 10_000


def test_a_file_that_cannot_be_plotted_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plain = tmp_path / "metrics.csv"
    plain.write_text("epoch,step,train_loss\n0,1,3.0\n")  # a DDP run: no comm/ keys
    cases = [
        ([str(plain)], "has no comm/sent_bytes column by step: log SCAPE's comm/ keys with CommunicationMonitor"),
        ([str(tmp_path / "missing.csv")], "No such file"),
    ]
    metrics = tmp_path / "scape.csv"
    _write(metrics, _rows())
    cases.append(([str(metrics), "--loss", "loss"], "has no column 'loss'"))
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(["plot", *args])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.strip().splitlines()[-1].startswith("lightning-scape plot: error:"), err
