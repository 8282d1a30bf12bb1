"""The demo's plot for any run: loss against step, and the bytes sent per step against DDP's (log axis).

:func:`plot_runs` draws it; the demo (:func:`~lightning_scape.examples.demo.write_plot`) gives it its two runs,
and ``lightning-scape plot`` (:func:`plot_metrics_csv`) a run of your own, from the metrics CSV a Lightning
``CSVLogger`` wrote: a Trainer fit with :class:`~lightning_scape.CommunicationMonitor`, a Fabric loop that logs
``comm.compute()``, or ``lightning-scape pretrain`` (``out_dir/logs/csv/.../metrics.csv``).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_scape.planning.run_summary import format_bytes, times_fewer

SENT_KEY = "comm/sent_bytes"
DDP_KEY = "comm/dense_equivalent_bytes"
# The loss columns tried, in order, when none is named: the Trainer examples', litgpt's.
TRAIN_LOSS_KEYS = ("train_loss", "train_loss_step", "loss")
VAL_LOSS_KEYS = ("val_loss", "val_loss_epoch")


class PlotError(ValueError):
    """A metrics file that cannot be plotted (missing, without the ``comm/`` keys, an unknown column)."""


@dataclass
class RunCurves:
    """One run's curves; any of them may be empty (DDP's bytes have no loss).

    Attributes:
        label: The run's name in the legends.
        train: (steps, values) of the training loss.
        train_label: How the legend names the training loss (``"train (mean of 20 steps)"``).
        val: The validation loss by step.
        sent: (steps, bytes sent by one process in the step).
        sent_label: The legend of the bytes (``"SCAPE d=0.01: 43.1 kB/step after the warm-up"``).
    """

    label: str
    train: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    train_label: str = "train"
    val: dict[int, float] = field(default_factory=dict)
    sent: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []))
    sent_label: str = ""


def plot_runs(runs: Sequence[RunCurves], path: Path, sparse_from: int | None = None, loss_label: str = "loss") -> bool:
    """Loss against step, and bytes sent per step against step (log axis); False without matplotlib.

    Bytes per step on a log axis keep SCAPE's sparse phase readable beside the dense steps (about 1 / density
    times more); the cumulative bytes on any axis squeeze it into a sliver after the warm-up.

    Args:
        runs: The runs, in the colours' order.
        path: The PNG to write (its folder is made).
        sparse_from: The first step SCAPE sends at its density, marked on both panels (None: no mark).
        loss_label: The loss axis's label.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    # Figure + savefig render with Agg without touching pyplot's global backend.
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_step, sent = fig.subplots(1, 2)
    for color, run in zip(("tab:blue", "tab:orange", "tab:green"), runs, strict=False):
        if run.train[0]:
            by_step.plot(*run.train, color=color, lw=1.2, label=f"{run.label} {run.train_label}")
        if run.val:
            val_steps = sorted(run.val)
            by_step.plot(val_steps, [run.val[s] for s in val_steps], "o--", color=color, lw=0.8, ms=5,
                         label=f"{run.label} validation")  # fmt: skip
        if run.sent[0]:
            per_step = [max(1.0, b) for b in run.sent[1]]  # log axis: a step that sent nothing shows as 1 byte
            sent.plot(run.sent[0], per_step, color=color, lw=1.2, label=run.sent_label or run.label)
    if sparse_from is not None:  # where SCAPE stops sending everything
        for ax in (by_step, sent):
            ax.axvline(
                sparse_from - 1, color="gray", ls=":", lw=1, label=f"SCAPE at its density from step {sparse_from}"
            )
    by_step.set(xlabel="step", ylabel=loss_label, title="Loss against step")
    sent.set(yscale="log", xlabel="step", ylabel="bytes sent by one process in the step",
             title="Bytes sent per step (log scale)")  # fmt: skip
    for ax in (by_step, sent):
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def read_metrics_csv(
    path: Path, loss_key: str | None = None, val_key: str | None = None
) -> tuple[RunCurves, RunCurves]:
    """SCAPE's run and DDP's bytes from a Lightning ``metrics.csv`` with the ``comm/`` keys.

    Args:
        path: The CSV file (``CSVLogger``'s ``metrics.csv``).
        loss_key: The training loss column; default the first of :data:`TRAIN_LOSS_KEYS` present (none: no loss).
        val_key: The validation loss column; default the first of :data:`VAL_LOSS_KEYS` present.

    Returns:
        The run (loss, validation loss, bytes sent per step) and DDP (the bytes its all-reduce would send).

    Raises:
        PlotError: No such file, no ``comm/`` keys in it, or a named column it does not have.
    """
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise PlotError(f"{path}: {exc.strerror or exc}") from None
    columns = set(rows[0]) if rows else set()
    if SENT_KEY not in columns or "step" not in columns:
        raise PlotError(
            f"{path} has no {SENT_KEY} column by step: log SCAPE's comm/ keys with CommunicationMonitor "
            "(Trainer callbacks; with Fabric, fabric.log_dict(monitor.compute(), step=step)) through a CSVLogger."
        )
    loss_key = _column(columns, loss_key, TRAIN_LOSS_KEYS, path)
    val_key = _column(columns, val_key, VAL_LOSS_KEYS, path)
    sent, ddp, train = _series(rows, SENT_KEY), _series(rows, DDP_KEY), _series(rows, loss_key)
    run = RunCurves(
        label="SCAPE",
        train=train,
        train_label=f"{loss_key} (as logged)",
        val=dict(zip(*_series(rows, val_key), strict=True)),
        sent=sent,
        sent_label=f"SCAPE: {format_bytes(sum(sent[1]) / max(1, len(sent[1])))} per step on average, "
        f"{times_fewer(sum(ddp[1]), sum(sent[1]))} fewer than DDP",
    )
    return run, RunCurves(label="DDP", sent=ddp, sent_label="DDP's all-reduce of the same gradients")


def _column(columns: set[str], named: str | None, defaults: Sequence[str], path: Path) -> str | None:
    """The column to read: ``named`` (which must exist), else the first of ``defaults`` present, else None."""
    if named is None:
        return next((key for key in defaults if key in columns), None)
    if named not in columns:
        raise PlotError(f"{path} has no column {named!r}; it has {', '.join(sorted(columns))}.")
    return named


def _series(rows: list[dict[str, str]], key: str | None) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where ``key`` was logged, by step (the last value of a step wins)."""
    if key is None:
        return [], []
    by_step = {int(float(row["step"])): float(row[key]) for row in rows if row.get(key) not in (None, "")}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_metrics_csv(
    path: Path, out: Path | None = None, loss_key: str | None = None, val_key: str | None = None
) -> Path:
    """``lightning-scape plot``: the demo's plot of the run logged in ``path``.

    Args:
        path: A ``metrics.csv`` with the ``comm/`` keys.
        out: The PNG to write; default ``scape.png`` beside ``path``.
        loss_key: The training loss column (default: :data:`TRAIN_LOSS_KEYS`).
        val_key: The validation loss column (default: :data:`VAL_LOSS_KEYS`).

    Returns:
        The PNG written.

    Raises:
        PlotError: What :func:`read_metrics_csv` refuses, or matplotlib not installed.
    """
    out = path.with_name("scape.png") if out is None else out
    if not plot_runs(read_metrics_csv(path, loss_key, val_key), out):
        raise PlotError("the plot needs matplotlib: pip install matplotlib (or the package's [plot] extra)")
    return out
