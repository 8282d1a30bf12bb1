"""``lightning-scape demo``: DDP + AdamS against SCAPE on real text, 2 CPU processes over gloo.

A small litgpt GPT (the ``"small"`` preset of :mod:`~lightning_scape.examples.workloads`) trains on a folder
of text (``--data``; by default the source files of this Python interpreter's standard library, a corpus
every machine has without a download). Both runs go through Lightning Fabric with ``ScapeStrategy`` and use
the same seed, data order and learning-rate schedule. The baseline, DDP + AdamS, all-reduces every fp32
gradient each step (what DDP sends) and runs SCAPE's optimizer, AdamS, on every rank; SCAPE takes the form it
chooses on a slow link (2.5% of the values as 8-bit codes, about 1/80 of the bytes DDP sends a step) after a
short dense warm-up and density ramp. The table reports tokens/s, bytes sent per step and their ratio to DDP
(after the warm-up and over the whole run), and the final train and validation loss, followed by notes on what
they mean; ``OUT/demo.csv`` holds every step and ``OUT/demo.png`` plots the loss and the bytes sent per step
against the step.

The command line (:mod:`lightning_scape_cli`) defines and parses the options, so that
``lightning-scape demo --help`` answers without importing torch, and passes them to :func:`run_demo` as a
:class:`DemoOptions`; this module never imports the command line.
"""

from __future__ import annotations

import csv
import logging
import os
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import lightning_utilities.core.rank_zero as rank_zero
import torch

from lightning_scape.config import ScapeConfig, WireFormat
from lightning_scape.engine import ScapeEngine
from lightning_scape.examples.run_plot import RunCurves, plot_runs
from lightning_scape.examples.workloads import (
    adams_optimizer,
    build_model,
    free_port,
    lm_loss,
    sample_batch,
    set_cosine_lr,
    validation_batch_losses,
)
from lightning_scape.fabric.strategy import ScapeStrategy
from lightning_scape.litgpt.data import TextFolder, TokenizerKind
from lightning_scape.planning.run_summary import format_bytes, times_fewer
from lightning_scape.warnings import DenseWarmupWarning

WORLD_SIZE = 2
METHODS = ("dense", "scape")
CSV_COLUMNS = ("method", "step", "train_loss", "bytes_sent", "cumulative_bytes_sent", "val_loss")
# A failed or stuck rank should end the demo in minutes, not after the strategies' 30-minute default.
COLLECTIVE_TIMEOUT = timedelta(minutes=2)
# Tokens/s differences below this fraction are noise on a shared machine: the notes call them the same.
SPEED_NOISE = 0.005
# How a sparse step of each wire sends its values (the run's description, the notes).
_AS_INT8: dict[WireFormat, str] = {"int8": " as 8-bit codes", "full": ""}
_SENT_WITH: dict[WireFormat, str] = {
    "int8": " as 8-bit codes with their indices, and the parameter changes at them as 8-bit codes",
    "full": ", with their indices and the new parameter values at them",
}


@dataclass  # not frozen: Fabric's spawn launcher rebuilds the dataclasses it passes to the processes
class DemoArgs:
    """What both runs share."""

    steps: int
    batch_size: int
    block_size: int
    lr: float
    dense_warmup_steps: int
    density_ramp_steps: int
    density: float
    wire_format: WireFormat
    eval_every: int
    eval_batches: int = 8


# ------------------------------------------------------------------------------------------ the runs


def method_label(method: str, args: DemoArgs) -> str:
    """How the table, the progress bar and the plot name a method."""
    if method == "dense":
        return "DDP + AdamS"
    return f"SCAPE {'int8 ' if args.wire_format == 'int8' else ''}d={args.density:g}"


def method_description(args: DemoArgs, method: str) -> str:
    """The line printed before a run starts: what the method sends."""
    if method == "dense":
        return "one fp32 all-reduce of every gradient per step, what DDP sends; AdamS on every rank"
    schedule = f"after {args.dense_warmup_steps} dense warm-up steps and a {args.density_ramp_steps}-step density ramp"
    return f"{schedule}, {args.density * 100:.3g}% of the values{_AS_INT8[args.wire_format]}"


class _DropScapeBanner(logging.Filter):
    """Drops the strategy's SCAPE schedule line: the dense baseline runs no SCAPE schedule."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("lightning_scape: SCAPE on")


def _progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (None without tqdm): redrawn at most once a second, every 10 s in a log file."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(
        total=total,
        desc=desc,
        unit="step",
        file=sys.stderr,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
        dynamic_ncols=True,
    )


def _train(fabric: L.Fabric, args: DemoArgs, method: str, tokens_file: str, vocab_size: int) -> dict[str, Any] | None:
    """One rank's run of ``method`` (started by ``fabric.launch``); rank 0 returns the results."""
    torch.set_num_threads(1)  # 2 processes on a 2-core machine: one thread each avoids oversubscription
    train, val = torch.load(tokens_file)
    rank = fabric.global_rank
    model = build_model(args.block_size, vocab_size)
    if method == "dense":  # the baseline is the strategy's dense step throughout: its log line would name a schedule
        # rank_zero_info writes to the logger lightning_utilities holds (Fabric's or the Trainer's, by import order).
        rank_zero.log.addFilter(_DropScapeBanner())
    model, opt = fabric.setup(model, adams_optimizer(model, args.lr))
    engine = fabric.strategy.engine  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data order, the same in both runs
    bar = _progress_bar(args.steps, method_label(method, args)) if fabric.is_global_zero else None
    losses: list[float] = []
    step_bytes: list[int] = []
    index_bytes: list[int] = []  # the mask indices among them: the bytes a dense step does not send
    cumulative: list[int] = []
    val_losses: dict[int, float] = {}
    eval_s = 0.0
    t0 = time.perf_counter()
    for step in range(args.steps):
        set_cosine_lr(opt, step, args.steps, args.lr)
        x, y = sample_batch(train, gen, args.batch_size, args.block_size)
        loss = lm_loss(model, x, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        step_bytes.append(engine.counters.step_sent_bytes)
        index_bytes.append(engine.counters.step_sent["indices"])
        cumulative.append(engine.counters.total_sent_bytes)
        done = step + 1
        if done % args.eval_every == 0 or done == args.steps:
            # Outside the clock: tokens/s measures training. The ranks share the fixed batches; each adds
            # zeros for the others' batches, so the sum is exact and equals one process's evaluation.
            te = time.perf_counter()
            model.eval()
            part = validation_batch_losses(model, val, args.block_size, args.eval_batches, rank, fabric.world_size)
            model.train()
            val_losses[done] = sum(_sum_over_ranks(fabric, part).tolist()) / args.eval_batches
            eval_s += time.perf_counter() - te
        if bar is not None:
            bar.set_postfix_str(f"loss {losses[-1]:.3f}, sent {step_bytes[-1] / 1e3:.1f} kB", refresh=False)
            bar.update(1)
    elapsed = time.perf_counter() - t0 - eval_s
    if bar is not None:
        bar.close()
    # The curve is the mean over the ranks (the loss of the whole global batch); one collective at the end
    # keeps the training loop free of extra synchronisation.
    mean_losses = _sum_over_ranks(fabric, torch.tensor(losses, dtype=torch.float64)) / fabric.world_size
    curves = {"bytes_sent": step_bytes, "index_bytes": index_bytes, "cumulative_bytes_sent": cumulative}
    result = _result(fabric, args, method, engine, mean_losses.tolist(), curves, val_losses, elapsed)
    # Fabric neither tears down nor destroys the process group when the function returns; a process that
    # exits with the engine's last all-gather in flight and gloo's threads running can abort.
    with warnings.catch_warnings():
        if method == "dense":  # dense on purpose: its "warm-up" is longer than the run
            warnings.simplefilter("ignore", DenseWarmupWarning)
        fabric.strategy.teardown()
    torch.distributed.destroy_process_group()
    return result if fabric.is_global_zero else None


def _sum_over_ranks(fabric: L.Fabric, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed element-wise over the ranks."""
    out = fabric.all_reduce(values, reduce_op="sum")
    assert isinstance(out, torch.Tensor)
    return out


def _result(
    fabric: L.Fabric,
    args: DemoArgs,
    method: str,
    engine: ScapeEngine,
    train_losses: list[float],
    curves: dict[str, list[int]],
    val_losses: dict[int, float],
    elapsed: float,
) -> dict[str, Any]:
    """The table's numbers and the curves of one run (rank 0's bytes, the ranks' mean loss)."""
    step_bytes = curves["bytes_sent"]
    settled = args.dense_warmup_steps + args.density_ramp_steps  # the steps before SCAPE sends at its density
    sparse = [b for i, b in enumerate(step_bytes) if method == "dense" or i >= settled]
    steps = args.steps
    return {
        "method": method,
        "label": method_label(method, args),
        "density": 1.0 if method == "dense" else args.density,
        "wire_format": "full" if method == "dense" else args.wire_format,
        "steps": steps,
        "warmup": 0 if method == "dense" else min(settled, steps),
        "params": engine.numel,
        "padded_params": engine.padded_numel,
        "tokens_per_s": steps * args.batch_size * args.block_size * fabric.world_size / elapsed,
        "train_seconds": elapsed,
        # SCAPE: its sparse steps after the dense warm-up (all steps when the warm-up is the whole run).
        "bytes_per_step": sum(sparse or step_bytes) / len(sparse or step_bytes),
        "bytes_per_step_all": engine.counters.total_sent_bytes / steps,
        "dense_equivalent_per_step": engine.counters.total_dense_equivalent / steps,
        "total_bytes": engine.counters.total_sent_bytes,
        "train_loss": sum(train_losses[-10:]) / len(train_losses[-10:]),
        "val_loss": val_losses[steps],
        "train_losses": train_losses,
        **curves,  # per step: bytes_sent, index_bytes (mask indices among them), cumulative_bytes_sent
        "val_losses": val_losses,
    }


@contextmanager
def _restored_environ() -> Iterator[None]:
    """Undo the variables Fabric sets in this process (``MASTER_PORT``, ...) once its run is over."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def method_config(args: DemoArgs, method: str) -> ScapeConfig:
    """The strategy's configuration for ``method``.

    Args:
        args: The settings both runs share.
        method: ``"dense"``: one all-reduce of every gradient, every step (what DDP sends), as a dense warm-up
            longer than the run; ``"scape"``: SCAPE at ``args.density`` on ``args.wire_format`` after its dense
            warm-up and density ramp.

    Returns:
        The configuration.

    Raises:
        ValueError: When ``args`` make an invalid configuration (a density outside (0, 1], ...).
    """
    if method == "dense":
        return ScapeConfig(
            wire_format="full",  # a fixed form: SCAPE measures nothing and chooses nothing in the baseline
            sharded=False,
            dense_warmup_steps=args.steps + 1,
            density_ramp_steps=0,
        )
    return ScapeConfig(
        density=args.density,
        wire_format=args.wire_format,
        dense_warmup_steps=args.dense_warmup_steps,
        density_ramp_steps=args.density_ramp_steps,
    )


def run_method(args: DemoArgs, method: str, tokens_file: str, vocab_size: int) -> dict[str, Any]:
    """Train ``method`` ("dense" or "scape") on ``WORLD_SIZE`` spawned CPU processes; rank 0's results.

    Args:
        args: The settings both runs share.
        method: ``"dense"`` or ``"scape"`` (see :func:`method_config`).
        tokens_file: A ``torch.save``'d ``(train_tokens, val_tokens)`` pair.
        vocab_size: The model's vocabulary size.

    Returns:
        The result dict of rank 0 (see the keys at the end of ``_result``).
    """
    strategy = ScapeStrategy(
        start_method="spawn",
        process_group_backend="gloo",
        timeout=COLLECTIVE_TIMEOUT,
        config=method_config(args, method),
    )
    strategy.log_run_summary = False  # the demo's table sums both runs up
    with _restored_environ():
        # A fresh port per run: the previous run's store may still hold its port in TIME_WAIT.
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        fabric = L.Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
        run = partial(_train, args=args, method=method, tokens_file=tokens_file, vocab_size=vocab_size)
        result = fabric.launch(run)
    assert isinstance(result, dict)
    return result


# ---------------------------------------------------------------------------------------- the outputs


def write_csv(results: Sequence[dict[str, Any]], path: Path) -> None:
    """One row per method and step: loss, bytes sent by rank 0, and the validation loss where measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(CSV_COLUMNS)
        for r in results:
            for i, (loss, sent, total) in enumerate(
                zip(r["train_losses"], r["bytes_sent"], r["cumulative_bytes_sent"], strict=True)
            ):
                val = r["val_losses"].get(i + 1)
                w.writerow([r["method"], i + 1, f"{loss:.6f}", sent, total, "" if val is None else f"{val:.6f}"])


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_plot(results: Sequence[dict[str, Any]], path: Path) -> bool:
    """Loss against step, and bytes sent per step against step (log axis); False without matplotlib
    (:func:`~lightning_scape.examples.run_plot.plot_runs`, which ``lightning-scape plot`` draws for a run of yours)."""
    runs = []
    for r in results:
        steps = list(range(1, r["steps"] + 1))
        after = " after the warm-up and ramp" if r["method"] == "scape" and r["warmup"] < r["steps"] else ""
        runs.append(
            RunCurves(
                label=r["label"],
                train=(steps, _smooth(r["train_losses"], 20)),
                train_label="train (mean of 20 steps)",
                val=r["val_losses"],
                sent=(steps, [float(b) for b in r["bytes_sent"]]),
                sent_label=f"{r['label']}: {format_bytes(r['bytes_per_step'])}/step{after}",
            )
        )
    warm = next((r for r in results if r["method"] == "scape" and 0 < r["warmup"] < r["steps"]), None)
    sparse_from = None if warm is None else warm["warmup"] + 1
    return plot_runs(runs, path, sparse_from=sparse_from, loss_label="loss (nats/token)")


def print_table(results: Sequence[dict[str, Any]], warmup: int) -> None:
    """The comparison table, then what its numbers mean (measured in this run)."""
    steps = results[0]["steps"]
    sparse_cols = 0 < warmup < steps  # SCAPE has sparse steps: show them apart from the whole run
    after = f"steps {warmup + 1}-{steps}"
    whole = f"steps 1-{steps}"
    ranges = [after, whole] if sparse_cols else [whole]
    w, name_w = 14, max(14, *(len(r["label"]) for r in results))
    head1 = f"{'':<{name_w}} {'':>9} " + f"{'kB sent per step':^{w * len(ranges) + len(ranges) - 1}} "
    head1 += f"{'DDP bytes / bytes sent':^{w * len(ranges) + len(ranges) - 1}}"
    head2 = f"{'method':<{name_w}} {'tokens/s':>9} " + " ".join(f"{c:>{w}}" for c in ranges) + " "
    head2 += " ".join(f"{c:>{w}}" for c in ranges) + f" {'train loss':>11} {'val loss':>9}"
    print("\n" + head1.rstrip() + "\n" + head2)
    for r in results:
        dense_eq = r["dense_equivalent_per_step"]
        per_step = [r["bytes_per_step"], r["bytes_per_step_all"]] if sparse_cols else [r["bytes_per_step_all"]]
        print(
            f"{r['label']:<{name_w}} {r['tokens_per_s']:>9.0f} "
            + " ".join(f"{b / 1e3:>{w}.1f}" for b in per_step)
            + " "
            + " ".join(f"{times_fewer(dense_eq, b):>{w}}" for b in per_step)
            + f" {r['train_loss']:>11.3f} {r['val_loss']:>9.3f}"
        )
    print()
    for note in demo_notes(results, warmup):
        print(textwrap.fill(note, width=110, initial_indent="- ", subsequent_indent="  "))


def demo_notes(results: Sequence[dict[str, Any]], warmup: int) -> list[str]:
    """What the table's numbers mean, with this run's own measurements."""
    by = {r["method"]: r for r in results}
    dense, scape = by.get("dense"), by.get("scape")
    steps = results[0]["steps"]
    notes = [
        f"{results[0]['params'] / 1e6:.2f}M parameters, {WORLD_SIZE} processes on this machine. Bytes: what one "
        "process sends per step (the other sends as much), counted by the engine with the ring formulas. Train "
        "loss: mean over the processes and the last 10 steps; val loss: after the last step, on fixed "
        "validation batches."
    ]
    if dense is None or scape is None:
        return notes
    if 0 < warmup < steps:
        notes.append(
            f"SCAPE sends the whole gradient in its dense warm-up, then less and less over its density ramp ("
            f"{warmup} steps together), then "
            f"{scape['density'] * 100:.3g}% of the values{_SENT_WITH[scape['wire_format']]}: "
            f"{times_fewer(scape['dense_equivalent_per_step'], scape['bytes_per_step'])} fewer bytes than DDP per "
            f"step after the warm-up, {times_fewer(scape['dense_equivalent_per_step'], scape['bytes_per_step_all'])} "
            "over this short run; the longer the run, the closer the whole run's ratio comes to the per-step one."
        )
    notes.extend(_index_exchange_notes(dense, scape))
    gap = scape["val_loss"] - dense["val_loss"]
    notes.append(
        f"Quality: SCAPE ends {abs(gap):.3f} nats ({abs(gap) / dense['val_loss']:.1%}) "
        f"{'above' if gap >= 0 else 'below'} DDP + AdamS in validation loss after {steps} steps. This is a "
        f"short run: at density {scape['density']:g} each coordinate is sent only a few times after the warm-up. "
        "docs/benchmarks.md (Quality) measures SCAPE's options against DDP + AdamS on this model; the SCAPE "
        "paper reports parity over runs of thousands of steps, which this demo does not reproduce."
    )
    notes.append(
        "Speed: both processes run on this machine and exchange their bytes over loopback, which is never the "
        f"bottleneck, so sending fewer bytes does not make a step faster here: {speed_phrase(scape, dense)} The "
        "wall-clock gain appears where the network is slow against compute: benchmarks/network/ runs this "
        "comparison over emulated 10 Gbit/s to 100 Mbit/s links between network namespaces (docs/benchmarks.md, "
        "section 1)."
    )
    return notes


def speed_phrase(scape: dict[str, Any], dense: dict[str, Any]) -> str:
    """SCAPE's tokens/s against DDP + AdamS's, as a sentence: the same within noise below 0.5%."""
    speed = scape["tokens_per_s"] / dense["tokens_per_s"] - 1
    if abs(speed) < SPEED_NOISE:
        return "the two throughputs are the same within noise."
    if speed > 0:
        return (
            f"SCAPE's tokens/s are {speed:.1%} higher than DDP + AdamS's, from the CPU time that copying DDP's "
            "larger messages through loopback takes from the compute, and from other load on this machine: not "
            "a measure of any network."
        )
    return (
        f"SCAPE's tokens/s are {-speed:.1%} lower than DDP + AdamS's, from SCAPE's own optimizer work (error "
        "feedback, the mask's top-k) and the other load on this machine, not from the bytes."
    )


def _index_exchange_notes(dense: dict[str, Any], scape: dict[str, Any]) -> list[str]:
    """Name the steps where SCAPE sends more than DDP + AdamS: the mask indices sent a step ahead.

    A mask is built and its int16 indices all-gathered at the end of the step before the one that uses it
    (``mask_delay=1``), so the last dense step also sends the first sparse step's indices. Differences of a
    few bytes (the gradient norm's all-reduce for clipping in the sharded step) are left out.
    """
    notes = []
    for i, (mine, ddp, indices) in enumerate(
        zip(scape["bytes_sent"], dense["bytes_sent"], scape["index_bytes"], strict=True)
    ):
        extra = mine - ddp
        if extra > 64:  # more than the few bytes of a scalar all-reduce
            notes.append(
                f"Step {i + 1}, SCAPE's last dense step, sends {format_bytes(extra)} more than DDP + AdamS: the "
                f"first sparse step's mask, {format_bytes(indices)} of int16 indices, which SCAPE builds and "
                "all-gathers at the end of the step before the one that uses it, so that the exchange overlaps the "
                "next forward pass (mask_delay=1). Every later step sends far less than a dense one."
            )
    return notes


# ------------------------------------------------------------------------------------------ the command


class DemoError(ValueError):
    """A demo setting, its text or its output folder that cannot work; raised before any process starts.

    The command line reports it as an argument error (one line, exit status 2).
    """


@dataclass(frozen=True)
class DemoOptions:
    """The ``lightning-scape demo`` options, as the command line (:mod:`lightning_scape_cli`) parsed them.

    The command line defines the options, their defaults and help, and checks that ``steps``, ``batch_size``
    and ``eval_every`` are at least 1; it builds this from its parsed arguments, so that ``--help`` answers
    without importing torch and this module never imports the command line.
    """

    steps: int
    batch_size: int
    block_size: int
    lr: float
    dense_warmup_steps: int
    density_ramp_steps: int
    density: float
    wire_format: WireFormat
    data: Path | None  # None: the Python standard library's sources
    tokenizer: TokenizerKind
    vocab_size: int
    max_bytes: int
    eval_every: int
    out: Path

    def run_args(self) -> DemoArgs:
        """The settings both runs share."""
        return DemoArgs(
            self.steps,
            self.batch_size,
            self.block_size,
            self.lr,
            self.dense_warmup_steps,
            self.density_ramp_steps,
            self.density,
            self.wire_format,
            self.eval_every,
        )


def _tokens(options: DemoOptions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize (or read the cache) here, once, so that neither the ranks nor tokens/s pay for it.

    Raises:
        DemoError: The text is missing, unreadable, or too short for a window on either split.
    """
    where = options.data or "the standard library"
    if options.data is not None and not options.data.exists():
        raise DemoError(f"--data {options.data}: no such file or directory")
    try:
        data = TextFolder(
            options.data, tokenizer=options.tokenizer, vocab_size=options.vocab_size, max_bytes=options.max_bytes
        )
        train, val = data.token_splits()
    except (OSError, ValueError) as exc:  # unreadable files, no text in the folder, a bad --max-bytes, ...
        raise DemoError(f"the text at {where}: {exc}") from exc
    for name, tokens in (("training", train), ("validation", val)):
        if len(tokens) <= options.block_size + 1:
            raise DemoError(
                f"the text at {where} gives {len(tokens)} {name} tokens; the demo needs more than --block-size + 1 "
                f"= {options.block_size + 1} (more text, or a larger --max-bytes)"
            )
    return train, val, data.vocab_size_bound


def _prepared(options: DemoOptions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Check every setting, tokenize the text and make the output folder, all before the first process starts.

    Returns:
        The training and validation tokens and the vocabulary size.

    Raises:
        DemoError: For any setting, text or output folder that cannot work.
    """
    args = options.run_args()
    try:  # the configurations of both runs, so that a bad SCAPE setting fails now, not after the dense run
        for method in METHODS:
            method_config(args, method)
    except ValueError as exc:
        raise DemoError(str(exc)) from exc
    train, val, vocab_size = _tokens(options)
    try:
        options.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"--out {options.out}: {exc}") from exc
    return train, val, vocab_size


def run_demo(options: DemoOptions) -> list[dict[str, Any]]:
    """Run DDP + AdamS then SCAPE on 2 processes, print the table, write the CSV and the plot.

    Args:
        options: The command line's options.

    Returns:
        Rank 0's result dict per method (dense first): the table's numbers and the per-step curves.

    Raises:
        DemoError: For a setting, text or output folder that cannot work, before any process starts.
    """
    train, val, vocab_size = _prepared(options)
    args = options.run_args()
    print(
        f"data: {options.data or 'the Python standard library'} ({options.tokenizer} tokens, vocabulary "
        f"{vocab_size}): {len(train):,} training and {len(val):,} validation tokens",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="scape-demo-") as tmp:
        # The ranks load the tokens from a file: cheaper than pickling them into every spawned process.
        tokens_file = os.path.join(tmp, "tokens.pt")
        torch.save((train, val), tokens_file)
        for method in METHODS:
            what = method_description(args, method)
            print(f"{method_label(method, args)} ({what}): {WORLD_SIZE} processes, gloo, CPU", flush=True)
            results.append(run_method(args, method, tokens_file, vocab_size))
    print_table(results, args.dense_warmup_steps + args.density_ramp_steps)
    csv_path, png_path = options.out / "demo.csv", options.out / "demo.png"
    write_csv(results, csv_path)
    print(f"\nper-step curves: {csv_path}")
    if write_plot(results, png_path):
        print(f"plot: {png_path}")
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return results
