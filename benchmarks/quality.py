"""Quality of SCAPE's options against dense AdamS at equal steps, on real text (``docs/algorithm.md`` section 7).

    python benchmarks/quality.py --steps 400 --out out/quality            # every configuration
    python benchmarks/quality.py --configs dense,default,no_catch_up       # a few
    python benchmarks/quality.py --corpus prose                            # on English prose, not code

Every configuration trains the README demo's model (``lightning_scape.workloads``: litgpt GPT, 0.86M
parameters, byte-level) on one of the workloads' corpora (``--corpus``: ``stdlib``, the Python standard
library's source, or ``prose``, the documentation that ships with Python; split into train and validation
by file) with W simulated ranks (``lightning_scape.simulate``: the exact algorithm of W ranks, in threads),
the same seed, data order, batch, LR schedule and clipping. Validation loss is measured on the same
held-out batches every ``--eval-every`` steps. Output: a markdown table (also written to
``OUT/quality.md``), a CSV of the curves and, with matplotlib, a PNG.
"""

from __future__ import annotations

import argparse
import csv
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_scape import ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.workloads import (
    CORPORA,
    adams_optimizer,
    build_model,
    corpus_tokens,
    lm_loss,
    sample_batch,
    set_cosine_lr,
    validation_loss,
)

DENSE = "dense"
# build_model seeds torch's global generator, which the simulated ranks (threads) share: build one
# model at a time, or each rank draws an interleaved part of the stream and the replicas start different.
_INIT_LOCK = threading.Lock()


def configurations(density: float, warmup: int) -> dict[str, dict[str, Any]]:
    """Named ScapeConfig overrides; ``dense`` is data-parallel AdamS (all-reduce every step)."""
    base: dict[str, Any] = {"density": density, "dense_warmup_steps": warmup}
    return {
        DENSE: {"sharded": False, "dense_warmup_steps": 10**9},
        "default": base,
        "no_catch_up": {**base, "catch_up": False},  # the algorithm as first written, without any correction
        "replicated": {**base, "sharded": False},
        "momentum_unmasked": {**base, "sharded": False, "unmasked_update": "momentum"},
        "staleness": {**base, "catch_up": False, "staleness_correction": True},
        "staleness+catch_up": {**base, "staleness_correction": True},
        "gradient_stat": {**base, "mask_statistic": "gradient"},
        "random_stat": {**base, "mask_statistic": "random"},
        "explore0": {**base, "exploration": 0.0},
        "explore0.3": {**base, "exploration": 0.3},
        "lr_x2": {**base, "sparse_lr_scale": 2.0},
        "d0.1": {**base, "density": 0.1},
        "catch_up_cap8": {**base, "catch_up_cap": 8.0},
        "catch_up_cap64": {**base, "catch_up_cap": 64.0},
        "catch_up_cap128": {**base, "catch_up_cap": 128.0},
    }


def train(
    rank: int,
    comm: Communicator,
    cfg: ScapeConfig,
    args: argparse.Namespace,
    tokens: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """One rank's run on ``tokens`` (train, validation); rank 0 returns the loss curves."""
    torch.set_num_threads(1)
    train_tokens, val_tokens = tokens
    with _INIT_LOCK:
        model = build_model(args.block_size)
    opt = adams_optimizer(model, args.lr)
    engine = ScapeEngine(opt, cfg, comm, list(model.parameters()))
    gen = torch.Generator().manual_seed(1234 + rank)
    curve: list[tuple[int, float, float]] = []
    window: list[float] = []
    for step in range(args.steps):
        set_cosine_lr(opt, step, args.steps, args.lr)
        x, y = sample_batch(train_tokens, gen, args.batch_size, args.block_size)
        loss = lm_loss(model, x, y)
        loss.backward()
        engine.step(max_grad_norm=1.0)
        engine.zero_grad()
        window = ([*window, float(loss.detach())])[-20:]
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val = validation_loss(model, val_tokens, args.block_size, args.eval_batches)
            curve.append((step + 1, sum(window) / len(window), val))
    sent = engine.counters.total_sent_bytes / args.steps
    engine.close()
    return {"curve": curve, "bytes_per_step": sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="all", help="comma-separated names, or 'all'")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=30, help="dense warm-up steps of the SCAPE runs")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--corpus", choices=CORPORA, default="stdlib", help="the text: Python's source or its docs")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of the corpus to read (files sorted)")
    ap.add_argument("--out", default="out/quality")
    args = ap.parse_args()

    table = configurations(args.density, args.warmup)
    names = list(table) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {list(table)}")
    if DENSE not in names:
        names.insert(0, DENSE)
    os.makedirs(args.out, exist_ok=True)
    # Read once here: the simulated ranks are threads of this process and share the (read-only) tokens.
    tokens = corpus_tokens(args.corpus, args.max_bytes)
    print(f"corpus {args.corpus}: {len(tokens[0]):,} train and {len(tokens[1]):,} validation tokens", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        cfg = ScapeConfig(**table[name])
        t0 = time.perf_counter()
        worker: Callable[[int, Communicator], dict[str, Any]] = lambda r, c, cfg=cfg: train(r, c, cfg, args, tokens)  # noqa: E731
        results[name] = simulate(args.world_size, worker)[0]
        final = results[name]["curve"][-1]
        print(f"{name:<20} val {final[2]:.4f}  train {final[1]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)

    dense_val = results[DENSE]["curve"][-1][2]
    dense_bytes = results[DENSE]["bytes_per_step"]
    lines = [
        f"{args.corpus} corpus, W={args.world_size} (simulated), {args.steps} steps, density {args.density}, "
        f"warm-up {args.warmup}, batch {args.batch_size}x{args.block_size} per rank, lr {args.lr} cosine, clip 1.0",
        "",
        "| configuration | val loss | vs dense | train loss | bytes vs dense (warm-up included) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        _, tr, val = r["curve"][-1]
        lines.append(
            f"| {name} | {val:.4f} | {val / dense_val:.3f} | {tr:.4f} | {r['bytes_per_step'] / dense_bytes:.4f} |"
        )
    report = "\n".join(lines)
    print("\n" + report)
    with open(os.path.join(args.out, "quality.md"), "w") as f:
        f.write(report + "\n")
    with open(os.path.join(args.out, "quality.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["configuration", "step", "train_loss", "val_loss"])
        for name, r in results.items():
            for step, tr, val in r["curve"]:
                w.writerow([name, step, f"{tr:.5f}", f"{val:.5f}"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for name, r in results.items():
            steps = [c[0] for c in r["curve"]]
            ax.plot(steps, [c[2] for c in r["curve"]], label=name, lw=2.5 if name == DENSE else 1.2)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.legend(fontsize=7)
        fig.savefig(os.path.join(args.out, "quality.png"), dpi=120, bbox_inches="tight")
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
