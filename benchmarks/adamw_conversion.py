"""Does a user's AdamW, converted to AdamS, train as it trained? On the models of ``benchmarks/user_models.py``.

Three parts, run one after the other (two cores: runs side by side slow each other down):

    python -m benchmarks.adamw_conversion --part optimizer   # one process: AdamW, AdamS, AdamS's previous rule
    python -m benchmarks.adamw_conversion --part steps       # one process: how far each step moves, by step
    python -m benchmarks.adamw_conversion --part scape       # W = 2 simulated: DDP + AdamW against SCAPE
    python -m benchmarks.adamw_conversion --report           # rewrite the tables and plots from OUT/runs.jsonl

``--part optimizer`` trains each workload with ``torch.optim.AdamW``, with the AdamS that SCAPE converts it to
(``lightning_scape.runtime.optimizer.to_adams``: same learning rate, betas, eps and weight decay), and with AdamS as
it was before its normaliser was bias-corrected (:class:`PreviousAdamS`, kept here as the reference of what
users got), over the grid users pass: betas (0.9, 0.999) (torch's default) and (0.9, 0.95) (the LLM convention),
learning rates 1e-4 to 3e-3, without and with a linear learning-rate warm-up over the first tenth of the run,
then a constant learning rate (as the examples have). One process, the examples' batch. The transformer is left
out of this grid (its 33,278-word output layer makes a step take about 3 s on 2 CPU cores: 6 hours for its
grid); the other two parts train it at learning rate 1e-3.

``--part steps`` trains the same three optimizers for 100 steps at learning rate 1e-3, both betas, no warm-up, and
records each step's update in units of the learning rate (weight decay left out): its RMS over the coordinates
and its 99th percentile. Adam moves a coordinate by about the learning rate at most; this shows where an
optimizer moves further, and when.

``--part scape`` trains each workload on W = 2 simulated ranks (``lightning_scape.simulate``: the exact algorithm,
in threads; each rank takes half the batch), from the same weights on the same batches: DDP + AdamW (the averaged
gradient, ``torch.optim.AdamW``), dense AdamS of the converted optimizer (every step dense: what the defaults run
on a fast link), and SCAPE at its defaults with the converted optimizer on a slow link (``scape_slow_link``: the
form pilot reads a 100 Mbit/s link, as ``benchmarks/quality.py``'s ``auto_100mbit`` does, and chooses sparse
steps), at learning rate 1e-3 with both betas, no warm-up, 600 steps (past the sparse form's dense warm-up and
ramp), the learning rate constant (as the examples have it) or on a cosine to zero.

Every run appends a record to ``OUT/runs.jsonl`` and a command skips the runs already there. The report
(``OUT/conversion.md``, ``OUT/curves.csv``, ``OUT/<part>_<workload>.png``) gives the final held-out loss (and
accuracy for the classifiers) of every run and the curves of held-out loss against step.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import reporting
from benchmarks.quality import GIVEN_LINKS, GivenLinkPilot
from benchmarks.user_models import WORKLOADS, Workload
from lightning_scape import ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.runtime.optimizer import to_adams

WORLD_SIZE = 2
LRS = (1e-4, 3e-4, 1e-3, 3e-3)
BETA2S = (0.999, 0.95)
OPTIMIZERS = ("adamw", "adams", "adams_previous")
SCAPE_METHODS = ("ddp_adamw", "ddp_adams", "scape_slow_link")
# The optimizer grid's length per workload; the transformer is not in the grid (its steps are the dearest).
GRID_STEPS = {"cnn": 300, "mlp": 300, "gpt": 300}
SCAPE_STEPS = 600
SCHEDULES = ("constant", "cosine")
SCAPE_LR = 1e-3
# A fixed form (a density given), so that no form pilot runs: every step dense, replicated (DDP's all-reduce).
DENSE_EVERY_STEP = {"sharded": False, "density": 0.01, "wire_format": "full", "dense_warmup_steps": 10**9}
WEIGHT_DECAY = 0.01  # torch's AdamW default, which the conversion keeps
STEP_PART_STEPS = 100


@dataclass(frozen=True)
class Run:
    """One training run."""

    part: str  # "optimizer" or "scape"
    workload: str
    method: str  # an optimizer of OPTIMIZERS, or a method of SCAPE_METHODS
    b2: float
    lr: float
    warmup: int  # linear learning-rate warm-up steps (0: none)
    steps: int
    seed: int = 0
    schedule: str = "constant"  # after the warm-up: "constant", or "cosine" to zero at the last step

    @property
    def key(self) -> str:
        return "|".join(str(v) for v in asdict(self).values())


# ------------------------------------------------------------------------------------------------ the optimizers


class PreviousAdamS(torch.optim.Optimizer):
    """AdamS as it stepped before its first step was bias-corrected: both momenta divided by ``1 - b1**t``, so
    ``nu = b2 (m_prev / c)^2 + (1 - b2) g^2`` weighs a zero momentum at t = 1 and the first step moves every
    coordinate by ``lr / sqrt(1 - b2)``. Here only to measure what users of that rule got."""

    def __init__(self, params: Iterable[Tensor], lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["t"], state["m"] = 0, torch.zeros_like(p)
                state["t"] += 1
                m, g, c = state["m"], p.grad, 1.0 - b1 ** state["t"]
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                nu = (m / c).square_().mul_(b2).add_(g.square(), alpha=1.0 - b2)
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                p.addcdiv_(m, nu.sqrt_().add_(group["eps"]), value=-group["lr"] / c)


def make_optimizer(name: str, model: nn.Module, lr: float, b2: float) -> torch.optim.Optimizer:
    """The user's ``AdamW(lr, betas=(0.9, b2))`` (torch's default weight decay 0.01), as ``name`` runs it."""
    adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, b2))
    if name == "adamw":
        return adamw
    if name == "adams":
        return to_adams(adamw)
    if name == "adams_previous":
        return PreviousAdamS(model.parameters(), lr=lr, betas=(0.9, b2), weight_decay=WEIGHT_DECAY)
    raise SystemExit(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def scheduled_lr(step: int, run: Run) -> float:
    """The learning rate of step ``step`` (0-based): linear from ``lr / warmup`` to ``lr``, then constant, or a cosine
    from ``lr`` to zero at the last step."""
    if step < run.warmup:
        return run.lr * (step + 1) / run.warmup
    if run.schedule == "cosine":
        return run.lr * 0.5 * (1.0 + math.cos(math.pi * (step - run.warmup) / max(1, run.steps - run.warmup)))
    return run.lr


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def evaluate(work: Workload, model: nn.Module) -> dict[str, float]:
    model.eval()
    out = work.evaluate(model)
    model.train()
    return out


def eval_steps(steps: int) -> set[int]:
    """Ten evaluations per run, and one before the first step."""
    every = max(1, steps // 10)
    return {0, *range(every, steps + 1, every)}


# ------------------------------------------------------------------------------------------------ the two parts


def train_one_process(run: Run) -> dict[str, Any]:
    """``--part optimizer``: one process, the example's batch."""
    torch.set_num_threads(2)
    work = WORKLOADS[run.workload]
    model = work.build(run.seed)
    opt = make_optimizer(run.method, model, run.lr, run.b2)
    gen = torch.Generator().manual_seed(1000 + run.seed)
    torch.manual_seed(run.seed)  # dropout
    curve, losses, moves = [], [], []
    params = list(model.parameters())
    for step in range(run.steps):
        if step in eval_steps(run.steps):
            curve.append({"step": step, **evaluate(work, model)})
        lr = scheduled_lr(step, run)
        set_lr(opt, lr)
        loss = work.loss(model, work.sample(gen, work.batch))
        opt.zero_grad()
        loss.backward()
        before = torch.cat([p.detach().flatten() for p in params]) if run.part == "steps" else None
        opt.step()
        losses.append(float(loss.detach()))
        if before is not None:
            moves.append(update_size(before, params, lr))
    curve.append({"step": run.steps, **evaluate(work, model)})
    return {"curve": curve, "train_loss": losses, "update": moves}


def update_size(before: Tensor, params: list[Tensor], lr: float) -> dict[str, float]:
    """The step's update in units of the learning rate, weight decay left out: its RMS over every coordinate and
    its 99th percentile of magnitude (Adam moves a coordinate by at most about lr per step, typically less)."""
    after = torch.cat([p.detach().flatten() for p in params])
    u = (before * (1.0 - lr * WEIGHT_DECAY) - after).abs_().div_(lr)
    p99 = float(u.kthvalue(max(1, int(0.99 * u.numel()))).values)
    return {"rms": float(u.square().mean().sqrt()), "p99": p99}


# The simulated ranks are threads: build one model at a time (torch's global generator is shared).
_INIT_LOCK = threading.Lock()


def train_rank(rank: int, comm: Communicator, run: Run) -> dict[str, Any]:
    """``--part scape``: one simulated rank, half the example's batch, its own batches."""
    torch.set_num_threads(1)
    work = WORKLOADS[run.workload]
    with _INIT_LOCK:
        model = work.build(run.seed)
    params = list(model.parameters())
    engine, pilot = None, None
    if run.method == "ddp_adamw":
        opt = make_optimizer("adamw", model, run.lr, run.b2)
    elif run.method == "ddp_adams":
        opt = make_optimizer("adams", model, run.lr, run.b2)
        engine = ScapeEngine(opt, ScapeConfig(**DENSE_EVERY_STEP), comm, params)  # type: ignore[arg-type]
    else:
        opt = make_optimizer("adams", model, run.lr, run.b2)
        pilot = GivenLinkPilot(GIVEN_LINKS["auto_100mbit"])
        engine = ScapeEngine(opt, ScapeConfig(), comm, params, form_pilot=pilot)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(1000 + 7 * rank + run.seed)
    curve, losses = [], []
    for step in range(run.steps):
        if rank == 0 and step in eval_steps(run.steps):
            sent = engine.counters.total_sent_bytes if engine else ddp_bytes(params, step)
            curve.append({"step": step, **evaluate(work, model), "bytes": sent})
        set_lr(opt, scheduled_lr(step, run))
        loss = work.loss(model, work.sample(gen, work.batch // WORLD_SIZE))
        loss.backward()
        if engine is not None:
            engine.step()
            engine.zero_grad()
        else:
            for p in params:  # DDP: the averaged gradient
                comm.all_reduce_sum(p.grad).wait()
                p.grad.div_(WORLD_SIZE)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    if rank == 0:
        sent = engine.counters.total_sent_bytes if engine else ddp_bytes(params, run.steps)
        curve.append({"step": run.steps, **evaluate(work, model), "bytes": sent})
    if engine is not None:
        engine.close()
    decisions = [] if pilot is None else [(d.step, d.chosen.name) for d in pilot.decisions]
    return {"curve": curve, "train_loss": losses, "decisions": decisions}


def ddp_bytes(params: list[Tensor], steps: int) -> int:
    """What a rank of DDP's ring all-reduce sends in ``steps`` steps: ``2 (W - 1) / W`` of the gradient bytes."""
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    return steps * 2 * (WORLD_SIZE - 1) * grad_bytes // WORLD_SIZE


def run_one(run: Run) -> dict[str, Any]:
    t0 = time.perf_counter()
    if run.part in ("optimizer", "steps"):
        rec = train_one_process(run)
    else:
        per_rank = simulate(WORLD_SIZE, lambda rank, comm: train_rank(rank, comm, run))
        rec = per_rank[0]
        rec["train_loss"] = [sum(x) / WORLD_SIZE for x in zip(*(r["train_loss"] for r in per_rank), strict=True)]
    return {**asdict(run), **rec, "seconds": time.perf_counter() - t0}


def planned(part: str, workloads: list[str], seeds: list[int]) -> list[Run]:
    runs = []
    for name in workloads:
        for seed in seeds:
            for b2 in BETA2S:
                if part == "scape":
                    for schedule in SCHEDULES:
                        runs += [Run("scape", name, m, b2, SCAPE_LR, 0, SCAPE_STEPS, seed, schedule)
                                 for m in SCAPE_METHODS]  # fmt: skip
                    continue
                if part == "steps":
                    runs += [Run("steps", name, opt, b2, SCAPE_LR, 0, STEP_PART_STEPS, seed) for opt in OPTIMIZERS]
                    continue
                if name not in GRID_STEPS:
                    continue
                steps = GRID_STEPS[name]
                for warmup in (0, steps // 10):
                    for lr in LRS:
                        runs += [Run("optimizer", name, opt, b2, lr, warmup, steps, seed) for opt in OPTIMIZERS]
    return runs


# ------------------------------------------------------------------------------------------------ report


def final(rec: dict[str, Any]) -> str:
    """The held-out loss at the end (and the accuracy, for the classifiers)."""
    last = rec["curve"][-1]
    return f"{last['loss']:.3f}" + (f" ({100 * last['accuracy']:.0f}%)" if "accuracy" in last else "")


def optimizer_tables(done: dict[str, dict[str, Any]], workloads: list[str]) -> list[str]:
    lines = []
    for name in workloads:
        recs = [r for r in done.values() if r["part"] == "optimizer" and r["workload"] == name and r["seed"] == 0]
        if not recs:
            continue
        steps = recs[0]["steps"]
        lines += ["", f"### {name}: held-out loss after {steps} steps, one process (AdamW / AdamS / AdamS before)", ""]
        header = "| betas | warm-up | " + " | ".join(f"lr {lr:g}" for lr in LRS) + " |"
        lines += [header, "|---|---|" + "---|" * len(LRS)]
        for b2 in BETA2S:
            for warmup in (0, steps // 10):
                cells = []
                for lr in LRS:
                    key = Run("optimizer", name, "{}", b2, lr, warmup, steps).key
                    parts = [done.get(key.replace("{}", opt)) for opt in OPTIMIZERS]
                    cells.append(" / ".join(final(r) if r else "-" for r in parts))
                lines.append(f"| (0.9, {b2}) | {warmup} | " + " | ".join(cells) + " |")
    return lines


def scape_table(done: dict[str, dict[str, Any]], workloads: list[str]) -> list[str]:
    lines = [
        "",
        f"### Under SCAPE: W = {WORLD_SIZE} simulated, lr {SCAPE_LR:g}, no warm-up, {SCAPE_STEPS} steps",
        "",
        "| workload | schedule | betas | seed | DDP + AdamW | dense AdamS (converted) | SCAPE, slow link (converted) "
        "| dense AdamS / DDP + AdamW | SCAPE / DDP + AdamW | SCAPE's form | SCAPE's bytes / DDP's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seeds = sorted({r["seed"] for r in done.values()})
    for name, schedule, b2, seed in itertools.product(workloads, SCHEDULES, BETA2S, seeds):
        runs = [Run("scape", name, m, b2, SCAPE_LR, 0, SCAPE_STEPS, seed, schedule) for m in SCAPE_METHODS]
        recs = [done.get(run.key) for run in runs]
        if not all(recs):
            continue
        ddp, dense, scape = recs
        dense_ratio, ratio = (r["curve"][-1]["loss"] / ddp["curve"][-1]["loss"] for r in (dense, scape))
        sent = scape["curve"][-1]["bytes"] / ddp["curve"][-1]["bytes"]
        form = reporting.form_switches(scape.get("decisions", []))
        lines.append(f"| {name} | {schedule} | (0.9, {b2}) | {seed} | {final(ddp)} | {final(dense)} | {final(scape)} "
                     f"| {dense_ratio:.3f} | {ratio:.3f} | {form} | {sent:.3f} |")  # fmt: skip
    return lines


STEP_COLUMNS = ((1, 1), (2, 2), (3, 3), (4, 10), (11, 30), (31, 100))


def steps_table(done: dict[str, dict[str, Any]], workloads: list[str]) -> list[str]:
    """RMS (and 99th percentile) of each step's update in units of lr, by step window, lr 1e-3, no warm-up."""
    cols = " | ".join(f"step {a}" if a == b else f"steps {a}-{b}" for a, b in STEP_COLUMNS)
    lines = [
        "",
        f"### Update size: RMS (99th percentile) of |update| / lr, one process, lr {SCAPE_LR:g}, no warm-up",
        "",
        f"| workload | betas | optimizer | {cols} |",
        "|---|---|---|" + "---|" * len(STEP_COLUMNS),
    ]
    for name in workloads:
        for b2 in BETA2S:
            for opt in OPTIMIZERS:
                rec = done.get(Run("steps", name, opt, b2, SCAPE_LR, 0, STEP_PART_STEPS).key)
                if rec is None:
                    continue
                cells = []
                for a, b in STEP_COLUMNS:
                    window = rec["update"][a - 1 : b]
                    rms = (sum(u["rms"] ** 2 for u in window) / len(window)) ** 0.5
                    cells.append(f"{rms:.2f} ({max(u['p99'] for u in window):.2f})")
                lines.append(f"| {name} | (0.9, {b2}) | {opt} | " + " | ".join(cells) + " |")
    return lines


def write_report(out: str, done: dict[str, dict[str, Any]]) -> str:
    names = list(WORKLOADS)
    sections = [*optimizer_tables(done, names), *steps_table(done, names), *scape_table(done, names)]
    text = "\n".join(["# AdamW converted to AdamS", *sections]) + "\n"
    with open(os.path.join(out, "conversion.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "curves.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["part", "workload", "method", "b2", "lr", "warmup", "steps", "seed", "step", "loss", "accuracy"])
        for rec in done.values():
            for point in rec["curve"]:
                w.writerow([rec["part"], rec["workload"], rec["method"], rec["b2"], rec["lr"], rec["warmup"],
                            rec["steps"], rec["seed"], point["step"], f"{point['loss']:.5f}",
                            f"{point.get('accuracy', float('nan')):.4f}"])  # fmt: skip
    plot(out, done)
    return text


def plot(out: str, done: dict[str, dict[str, Any]]) -> None:
    """Per part and workload: held-out loss against step, one panel per betas (lr 1e-3; the grid: no warm-up)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    plot_update_sizes(out, done, Figure)
    for part, methods in (("optimizer", OPTIMIZERS), ("scape", SCAPE_METHODS)):
        for name in WORKLOADS:
            recs = [
                r
                for r in done.values()
                if r["part"] == part
                and r["workload"] == name
                and r["lr"] == 1e-3
                and r["warmup"] == 0
                and r.get("seed", 0) == 0
                and r["method"] in methods  # records of a method since retired are left out
            ]
            if not recs:
                continue
            fig = Figure(figsize=(12, 4.2), layout="constrained")
            axes = fig.subplots(1, len(BETA2S), sharey=True)
            for ax, b2 in zip(axes, BETA2S, strict=True):
                for rec in recs:
                    if rec["b2"] != b2:
                        continue
                    steps = [p["step"] for p in rec["curve"]]
                    schedule = rec.get("schedule", "constant")
                    style = {"color": f"C{methods.index(rec['method'])}", "ls": "-" if schedule == "constant" else "--"}
                    ax.plot(steps, [p["loss"] for p in rec["curve"]], label=f"{rec['method']} ({schedule} lr)",
                            **style)  # fmt: skip
                ax.set(title=f"{name}, betas (0.9, {b2}), lr 1e-3", xlabel="step", ylabel="held-out loss")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
            fig.savefig(os.path.join(out, f"{part}_{name}.png"), dpi=100)


def plot_update_sizes(out: str, done: dict[str, dict[str, Any]], figure: Any) -> None:
    """``steps_<workload>.png``: the RMS of each step's update in units of lr, and the training loss, by step."""
    for name in WORKLOADS:
        recs = [r for r in done.values() if r["part"] == "steps" and r["workload"] == name]
        if not recs:
            continue
        fig = figure(figsize=(12, 6.5), layout="constrained")
        axes = fig.subplots(2, len(BETA2S), sharex=True)
        for col, b2 in enumerate(BETA2S):
            for rec in recs:
                if rec["b2"] != b2:
                    continue
                steps = range(1, len(rec["update"]) + 1)
                style = {"color": f"C{OPTIMIZERS.index(rec['method'])}", "label": rec["method"]}
                axes[0][col].plot(steps, [u["rms"] for u in rec["update"]], **style)
                axes[1][col].plot(steps, rec["train_loss"], **style)
            axes[0][col].set(title=f"{name}, betas (0.9, {b2}), lr 1e-3", ylabel="RMS of update / lr", yscale="log")
            axes[1][col].set(xlabel="step", ylabel="training loss")
            for ax in axes[:, col]:
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7)
        fig.savefig(os.path.join(out, f"steps_{name}.png"), dpi=100)


def load_runs(path: str) -> dict[str, dict[str, Any]]:
    done: dict[str, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = {**asdict(Run("", "", "", 0.0, 0.0, 0, 0)), **json.loads(line)}  # fields added since: defaults
                done[Run(**{k: rec[k] for k in Run.__dataclass_fields__}).key] = rec
    return done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("optimizer", "steps", "scape"))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {list(WORKLOADS)}")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--out", default="out/adamw_conversion")
    ap.add_argument("--report", action="store_true", help="only rewrite the report from OUT/runs.jsonl")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "runs.jsonl")
    done = load_runs(path)
    if args.part and not args.report:
        names = args.workloads.split(",")
        unknown = sorted(set(names) - set(WORKLOADS))
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
        for run in planned(args.part, names, [int(s) for s in args.seeds.split(",")]):
            if run.key in done:
                continue
            rec = run_one(run)
            done[run.key] = rec
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{run.key}: {final(rec)} ({rec['seconds']:.0f} s)", flush=True)
    print(write_report(args.out, done))


if __name__ == "__main__":
    main()
