"""Where SCAPE's sparse update loses ground to DDP + AdamS: the age of what it sends, and what the cap cuts.

Trains the quality benchmark's workload (``benchmarks/quality.py``: the small GPT, W = 2 simulated ranks,
16 x 128 bytes per rank, cosine LR peak 1.5e-3 over ``--schedule-steps``) under one of its configurations
and prints, per block of 100 steps, for the coordinates the sparse steps send:

- tau: how many steps since each was last sent (mean, median, 90th percentile);
- "again": the share sent again at once (tau = 1, one plain AdamS step);
- "capped": the share whose interval update hits ``catch_up_cap``;
- "cut": the share of the interval update's total displacement that the cap removes;
- the median global gradient norm that clipping at 1.0 sees, and how often it clips.

    python benchmarks/interval_diagnostics.py --config default --steps 700

``docs/algorithm.md`` section 7 reads the numbers. Needs no GPU; 700 steps take about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import threading
from collections import defaultdict
from typing import Any

import torch
from quality import BLOCK, CLIP, PEAK_LR, scape_config  # type: ignore[import-not-found]
from torch import Tensor

import lightning_scape.kernels as K
from lightning_scape import ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.examples.workloads import (
    adams_optimizer,
    build_model,
    corpus_tokens,
    lm_loss,
    sample_batch,
    set_cosine_lr,
)
from lightning_scape.kernels import AdamSHyper
from lightning_scape.kernels._positions import mask_positions
from lightning_scape.kernels.sparse_adams import _interval_update

BLOCK_STEPS = 100


class SendLog:
    """Per block of steps: the ages of the sent coordinates and the displacement the cap removes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taus: dict[int, list[Tensor]] = defaultdict(list)
        self.capped: dict[int, int] = defaultdict(int)
        self.moved: dict[int, float] = defaultdict(float)
        self.wanted: dict[int, float] = defaultdict(float)

    def record(
        self, momentum: Tensor, last_sent: Tensor, gbar: Tensor, mask: Tensor, chunk: int, h: AdamSHyper
    ) -> None:
        """Log one bucket region's sparse update of step ``h.step`` (called before the op runs)."""
        pos = mask_positions(mask, chunk)
        tau = (h.step - last_sent.index_select(0, pos)).double()
        m_prev, g = momentum.index_select(0, pos).double(), gbar.double()
        _, capped = _interval_update(m_prev, g, tau, h)
        _, free = _interval_update(m_prev, g, tau, dataclasses.replace(h, catch_up_cap=math.inf))
        # tau = 1 takes AdamS's own step (bounded by B by construction): the cap never applies there.
        capped = torch.where(tau == 1, free, capped)
        block = (h.step - 1) // BLOCK_STEPS
        with self.lock:
            self.taus[block].append(tau)
            self.capped[block] += int((capped.abs() < free.abs() * (1 - 1e-9)).sum())
            self.moved[block] += float(capped.abs().sum())
            self.wanted[block] += float(free.abs().sum())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="default", help="a configuration name of benchmarks/quality.py")
    ap.add_argument("--steps", type=int, default=700, help="steps to train and report")
    ap.add_argument("--schedule-steps", type=int, default=1000, help="the length of the cosine learning rate")
    ap.add_argument("--corpus", default="stdlib")
    args = ap.parse_args(argv)
    config = scape_config(args.config)
    tokens = corpus_tokens(args.corpus)
    log = SendLog()
    sparse_adams = K.sparse_adams

    def logged(param: Tensor, momentum: Tensor, last_sent: Tensor, gbar: Tensor, mask: Tensor, chunk: int,
               out: Tensor, hyper: AdamSHyper) -> None:  # fmt: skip
        log.record(momentum, last_sent, gbar, mask, chunk, hyper)
        sparse_adams(param, momentum, last_sent, gbar, mask, chunk, out, hyper)

    K.sparse_adams = logged  # the engine calls the op through the module

    def train(rank: int, comm: Communicator) -> list[float]:
        torch.set_num_threads(1)
        model = build_model(BLOCK, preset="small", seed=0)
        opt = adams_optimizer(model, PEAK_LR)
        engine = ScapeEngine(opt, config, comm, list(model.parameters()))
        gen = torch.Generator().manual_seed(1234 + rank)
        norms = []
        for step in range(args.steps):
            set_cosine_lr(opt, step, args.schedule_steps, PEAK_LR)
            x, y = sample_batch(tokens[0], gen, 16, BLOCK)
            lm_loss(model, x, y).backward()
            engine.step(max_grad_norm=CLIP)
            engine.zero_grad()
            norms.append(engine.last_grad_norm)
        engine.close()
        return norms

    norms = simulate(2, train)[0]
    print(f"{args.config}: {config}")
    print("| steps | sent | tau mean | tau median | tau p90 | again | capped | cut | grad norm (median) | clipped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for block in range(math.ceil(args.steps / BLOCK_STEPS)):
        seg = norms[block * BLOCK_STEPS : (block + 1) * BLOCK_STEPS]
        row: list[Any] = [f"{block * BLOCK_STEPS + 1}-{block * BLOCK_STEPS + len(seg)}"]
        if log.taus[block]:
            tau = torch.cat(log.taus[block])
            n = tau.numel()
            cut = 1 - log.moved[block] / log.wanted[block]
            row += [n, f"{float(tau.mean()):.1f}", f"{float(tau.median()):.0f}",
                    f"{float(torch.quantile(tau[:2**24], 0.9)):.0f}", f"{float((tau == 1).sum()) / n:.0%}",
                    f"{log.capped[block] / n:.1%}", f"{cut:.1%}"]  # fmt: skip
        else:
            row += ["dense"] + [""] * 6
        row += [f"{statistics.median(seg):.3f}", f"{sum(n > CLIP for n in seg) / len(seg):.0%}"]
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
