"""The README demo: dense AdamS against SCAPE (d = 0.01) on real text, 2 CPU processes over gloo.

A small litgpt GPT (about 0.86M parameters with byte tokens) trains on a folder of text (``--data``; by
default the source files of this Python interpreter's standard library, a corpus every machine has without
a download). Both runs go through Lightning Fabric with ``ScapeStrategy`` and use the same seed, data order
and learning-rate schedule; the dense one all-reduces every gradient (what DDP sends), the SCAPE one sends
1% of the values after a short dense warm-up. The table reports tokens/s, bytes sent per step, the
compression ratio, and the final train and validation loss; ``OUT/demo.csv`` holds every step and
``OUT/demo.png`` plots loss against step and against bytes sent.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_scape.config import ScapeConfig
from lightning_scape.data import TextFolder
from lightning_scape.engine import ScapeEngine
from lightning_scape.strategy import ScapeStrategy
from lightning_scape.workloads import (
    adams_optimizer,
    build_model,
    free_port,
    lm_loss,
    sample_batch,
    set_cosine_lr,
    validation_batch_losses,
)

WORLD_SIZE = 2
METHODS = ("dense", "scape")
CSV_COLUMNS = ("method", "step", "train_loss", "bytes_sent", "cumulative_bytes_sent", "val_loss")
# A failed or stuck rank should end the demo in minutes, not after ScapeConfig's 30-minute default.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass  # not frozen: Fabric's spawn launcher rebuilds the dataclasses it passes to the processes
class DemoArgs:
    """What both runs share."""

    steps: int
    batch_size: int
    block_size: int
    lr: float
    warmup: int
    density: float
    eval_every: int
    eval_batches: int = 8


# ------------------------------------------------------------------------------------------ the runs


def method_label(method: str, density: float) -> str:
    """How the table, the progress bar and the plot name a method."""
    return "dense AdamS" if method == "dense" else f"SCAPE d={density:g}"


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
    model, opt = fabric.setup(model, adams_optimizer(model, args.lr))
    engine = fabric.strategy.engine  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data order, the same in both runs
    bar = _progress_bar(args.steps, method_label(method, args.density)) if fabric.is_global_zero else None
    losses: list[float] = []
    step_bytes: list[int] = []
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
    result = _result(fabric, args, method, engine, mean_losses.tolist(), step_bytes, cumulative, val_losses, elapsed)
    # Fabric neither tears down nor destroys the process group when the function returns; a process that
    # exits with the engine's last all-gather in flight and gloo's threads running can abort.
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
    step_bytes: list[int],
    cumulative: list[int],
    val_losses: dict[int, float],
    elapsed: float,
) -> dict[str, Any]:
    """The table's numbers and the curves of one run (rank 0's bytes, the ranks' mean loss)."""
    sparse = [b for i, b in enumerate(step_bytes) if method == "dense" or i >= args.warmup]
    steps = args.steps
    return {
        "method": method,
        "label": method_label(method, args.density),
        "steps": steps,
        "warmup": 0 if method == "dense" else min(args.warmup, steps),
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
        "bytes_sent": step_bytes,
        "cumulative_bytes_sent": cumulative,
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
            longer than the run; ``"scape"``: SCAPE at ``args.density`` after ``args.warmup`` dense steps.

    Returns:
        The configuration.

    Raises:
        ValueError: When ``args`` make an invalid configuration (a density outside (0, 1], ...).
    """
    if method == "dense":
        return ScapeConfig(sharded=False, dense_warmup_steps=args.steps + 1, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    return ScapeConfig(density=args.density, dense_warmup_steps=args.warmup, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


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
    strategy = ScapeStrategy(start_method="spawn", process_group_backend="gloo", config=method_config(args, method))
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
        w = csv.writer(fh)
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
    """Loss against step and against cumulative bytes sent (log axis), both methods; False without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    # Figure + savefig render with Agg without touching pyplot's global backend.
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    by_step, by_bytes = fig.subplots(1, 2)
    for color, r in zip(("tab:blue", "tab:orange"), results, strict=False):
        steps = list(range(1, r["steps"] + 1))
        smooth = _smooth(r["train_losses"], 20)
        val_steps = sorted(r["val_losses"])
        val = [r["val_losses"][s] for s in val_steps]
        val_bytes = [r["cumulative_bytes_sent"][s - 1] for s in val_steps]
        for ax, x, xv in ((by_step, steps, val_steps), (by_bytes, r["cumulative_bytes_sent"], val_bytes)):
            ax.plot(x, smooth, color=color, lw=1.2, label=f"{r['label']} train (mean of 20 steps)")
            ax.plot(xv, val, "o--", color=color, lw=0.8, ms=5, label=f"{r['label']} validation")
    warm = next((r for r in results if r["method"] == "scape" and 0 < r["warmup"] < r["steps"]), None)
    if warm is not None:  # where SCAPE stops sending everything: its curve leaves dense AdamS's there
        label = f"end of SCAPE's dense warm-up (step {warm['warmup']})"
        by_step.axvline(warm["warmup"], color="gray", ls=":", lw=1, label=label)
        by_bytes.axvline(warm["cumulative_bytes_sent"][warm["warmup"] - 1], color="gray", ls=":", lw=1, label=label)
    by_step.set(xlabel="step", ylabel="loss (nats/token)", title="Loss against step")
    by_bytes.set(
        xscale="log",
        xlabel="bytes sent by rank 0 (cumulative)",
        ylabel="loss (nats/token)",
        title="Loss against bytes sent",
    )
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def print_table(results: Sequence[dict[str, Any]], warmup: int) -> None:
    """The comparison table, with a note on what the columns count."""
    print(
        f"\n{'method':<14} {'steps':>6} {'tokens/s':>9} {'kB sent/step':>13} {'(all steps)':>12} {'vs DDP':>8} "
        f"{'(all steps)':>12} {'train loss':>11} {'val loss':>9}"
    )
    for r in results:
        dense_eq = r["dense_equivalent_per_step"]
        print(
            f"{r['label']:<14} {r['steps']:>6} {r['tokens_per_s']:>9.0f} {r['bytes_per_step'] / 1e3:>13.1f} "
            f"{r['bytes_per_step_all'] / 1e3:>12.1f} {dense_eq / max(1.0, r['bytes_per_step']):>7.1f}x "
            f"{dense_eq / max(1.0, r['bytes_per_step_all']):>11.1f}x {r['train_loss']:>11.3f} {r['val_loss']:>9.3f}"
        )
    note = (
        f"{results[0]['params'] / 1e6:.2f}M parameters, {WORLD_SIZE} processes. kB sent/step: what one rank sends; "
        f"SCAPE's counts its sparse steps after {warmup} dense warm-up steps, '(all steps)' includes them. 'vs DDP': "
        "what DDP's all-reduce of the gradients would send, divided by that. Train loss: mean over the ranks and "
        "the last 10 steps; val loss: after the last step, on fixed validation batches."
    )
    print("\n" + textwrap.fill(note, width=110))


# ------------------------------------------------------------------------------------------ the CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lightning-scape demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine schedule)")
    ap.add_argument("--warmup", type=int, default=30, help="SCAPE dense warm-up steps")
    ap.add_argument("--density", type=float, default=0.01, help="SCAPE density")
    ap.add_argument(
        "--data", type=Path, default=None, help="a folder of text files, or one file (default: the Python stdlib's)"
    )
    ap.add_argument(
        "--tokenizer", choices=("byte", "bpe"), default="byte", help="byte tokens, or a BPE trained on the text"
    )
    ap.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (ignored for byte tokens)")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of text to read")
    ap.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (and after the last)")
    ap.add_argument("--out", type=Path, default=Path("out/demo"), help="where demo.csv and demo.png go")
    return ap


def _tokens(ap: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tokenize (or read the cache) here, once, so that neither the ranks nor tokens/s pay for it."""
    if ns.data is not None and not ns.data.exists():
        ap.error(f"--data {ns.data}: no such file or directory")
    try:
        data = TextFolder(ns.data, tokenizer=ns.tokenizer, vocab_size=ns.vocab_size, max_bytes=ns.max_bytes)
        train, val = data.token_splits()
        vocab_size = data.vocab_size_bound
    except (OSError, ValueError) as exc:  # unreadable files, no text in the folder, a bad --max-bytes, ...
        ap.error(f"the text at {ns.data or 'the standard library'}: {exc}")
    for name, tokens in (("training", train), ("validation", val)):
        if len(tokens) <= ns.block_size + 1:
            ap.error(
                f"the text at {ns.data or 'the standard library'} gives {len(tokens)} {name} tokens; the demo needs "
                f"more than --block-size + 1 = {ns.block_size + 1} (more text, or a larger --max-bytes)"
            )
    return train, val, vocab_size


def run_demo(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse the demo's arguments, run dense AdamS then SCAPE on 2 processes, print the table, write CSV and PNG.

    Args:
        argv: The arguments after ``demo`` (default: ``sys.argv[1:]``).

    Returns:
        Rank 0's result dict per method (dense first): the table's numbers and the per-step curves.

    Raises:
        SystemExit: With status 2 and a one-line message for bad arguments or unusable ``--data``.
    """
    ap = _parser()
    ns = ap.parse_args(argv)
    for flag, value in (("--steps", ns.steps), ("--batch-size", ns.batch_size), ("--eval-every", ns.eval_every)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    args = DemoArgs(ns.steps, ns.batch_size, ns.block_size, ns.lr, ns.warmup, ns.density, ns.eval_every)
    try:  # every argument is checked before the first process starts, not after the dense run
        for method in METHODS:
            method_config(args, method)
    except ValueError as exc:
        ap.error(str(exc))
    train, val, vocab_size = _tokens(ap, ns)
    try:
        ns.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--out {ns.out}: {exc}")
    print(
        f"data: {ns.data or 'the Python standard library'} ({ns.tokenizer} tokens, vocabulary {vocab_size}): "
        f"{len(train):,} training and {len(val):,} validation tokens",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="scape-demo-") as tmp:
        # The ranks load the tokens from a file: cheaper than pickling them into every spawned process.
        tokens_file = os.path.join(tmp, "tokens.pt")
        torch.save((train, val), tokens_file)
        for method in METHODS:
            what = "all-reduce every step" if method == "dense" else f"after {args.warmup} dense warm-up steps"
            print(f"{method_label(method, args.density)} ({what}): {WORLD_SIZE} processes, gloo, CPU", flush=True)
            results.append(run_method(args, method, tokens_file, vocab_size))
    print_table(results, args.warmup)
    csv_path, png_path = ns.out / "demo.csv", ns.out / "demo.png"
    write_csv(results, csv_path)
    print(f"\nper-step curves: {csv_path}")
    if write_plot(results, png_path):
        print(f"plot: {png_path}")
    else:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
    return results


if __name__ == "__main__":
    run_demo(sys.argv[1:])
