"""Quality of SCAPE against dense data-parallel AdamS at equal steps, on real text.

One command per table of ``docs/benchmarks.md`` (section Quality); run them one after another (two cores:
runs side by side slow each other down):

    python benchmarks/quality.py --table headline      # defaults vs dense: 1000 steps, 2 corpora, 2 seeds
    python benchmarks/quality.py --table horizons      # defaults vs dense: 300 steps, 2 corpora, 2 seeds
    python benchmarks/quality.py --table long          # defaults vs dense: 3000 steps, 2 corpora
    python benchmarks/quality.py --table catch_up      # catch_up_cap: 1000 steps
    python benchmarks/quality.py --table schedule      # dense warm-up and density ramp: 1000 steps
    python benchmarks/quality.py --table mask          # statistic, exploration, replicated mode: 1000 steps
    python benchmarks/quality.py --table mask_int8     # the same on the int8 wire at d = 0.025: 1000 steps, 2 seeds
    python benchmarks/quality.py --table mask_switch   # raw-gradient masks first, then the paper's: 2 corpora, 2 seeds
    python benchmarks/quality.py --table density       # density 0.02, 0.04, 0.1: 1000 steps
    python benchmarks/quality.py --table scale         # a 5.7x larger model, a 4x larger batch: 1000 steps
    python benchmarks/quality.py --table sparse_lr     # the sparse steps' learning rate x1.5, x2: 1000 steps
    python benchmarks/quality.py --table wire          # the int8 wire against fp32: 1000 steps, 2 corpora, 2 seeds

or any set of runs: ``--configs dense,default --corpora stdlib --steps 300 --seeds 0``.

Every run trains the small litgpt GPT of ``lightning_scape.examples.workloads`` (4 layers, 128 wide, 0.86M parameters,
byte tokens) on one of its corpora (``stdlib``: the Python standard library's source; ``prose``: the
documentation that ships with Python; both split into train and validation by file) with W = 2 simulated
ranks (``lightning_scape.simulate``: the exact algorithm of W ranks, in threads), 16 sequences of 128 bytes
per rank and step, AdamS with a cosine learning rate (peak 1.5e-3, 20 warm-up steps, zero at the last step)
and global-norm clipping at 1.0. A seed fixes the initialisation and the data order; every configuration
of a seed sees the same batches, and every run is evaluated on the same validation batches.

Each finished run is appended to ``OUT/runs.jsonl``, and a command skips the runs already there, so a long
command can be stopped and resumed. ``--report`` rewrites, from that file: ``OUT/quality.md`` (the tables),
``OUT/curves.csv`` (validation loss and bytes at every evaluation) and ``OUT/<corpus>_<steps>.png``
(validation loss against step and against bytes sent).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_scape import FormPilot, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.config import MIN_MEASURED_STEPS
from lightning_scape.examples.workloads import (
    CORPORA,
    adams_optimizer,
    build_model,
    corpus_tokens,
    lm_loss,
    sample_batch,
    set_cosine_lr,
    validation_loss,
)
from lightning_scape.planning.network import Cluster, Collective, Link
from lightning_scape.planning.pilot import PROBE_LARGE_NUMEL, PROBE_SMALL_NUMEL, timed_gather

DENSE = "dense"
WORLD_SIZE = 2
BLOCK = 128
# The peak learning rate at which dense AdamS does best on this model at 1000 steps (validation loss 1.080 at
# 1e-3, 1.076 at 1.5e-3, 1.143 at 3e-3, 1.317 at 6e-3): the baseline is tuned, not flattered.
PEAK_LR = 1.5e-3
CLIP = 1.0
EVAL_BATCHES = 16  # 16 x 16 windows of 128 bytes: 32k validation tokens, the same for every run

# The schedule the option tables (catch_up, sparse_lr) vary one field around: a 100-step dense warm-up and a
# 200-step geometric density ramp, every other field the package's default.
_W100_R200: dict[str, Any] = {"dense_warmup_steps": 100, "density_ramp_steps": 200}

# Named configurations: ScapeConfig overrides of the package defaults. ``dense`` all-reduces every gradient
# every step (what DDP sends) and steps AdamS: the baseline every ratio is taken against.
CONFIGS: dict[str, dict[str, Any]] = {
    DENSE: {"sharded": False, "dense_warmup_steps": 10**9},
    "default": {},
    # The schedule: w dense warm-up steps, then a geometric density ramp of r steps.
    "w100_r0": {"dense_warmup_steps": 100, "density_ramp_steps": 0},
    "w100_r100": {"dense_warmup_steps": 100, "density_ramp_steps": 100},
    "w100_r200": _W100_R200,
    "w100_r400": {"dense_warmup_steps": 100, "density_ramp_steps": 400},
    "w50_r200": {"dense_warmup_steps": 50, "density_ramp_steps": 200},
    "w200_r200": {"dense_warmup_steps": 200, "density_ramp_steps": 200},
    "w50_r300": {"dense_warmup_steps": 50, "density_ramp_steps": 300},
    "w30_r400": {"dense_warmup_steps": 30, "density_ramp_steps": 400},
    # How far a coordinate catches up at once (steps at the peak learning rate; the package's default is 32).
    "cap8": {**_W100_R200, "catch_up_cap": 8.0},
    "cap16": {**_W100_R200, "catch_up_cap": 16.0},
    "cap64": {**_W100_R200, "catch_up_cap": 64.0},
    "no_cap": {**_W100_R200, "catch_up_cap": 1e9},
    # The mask.
    "gradient_stat": {},  # the raw-gradient statistic |e|: see GRADIENT_STATISTIC
    "explore0": {"exploration": 0.0},
    "explore0.3": {"exploration": 0.3},
    # Density and mode.
    "d0.02": {"density": 0.02},
    "d0.04": {"density": 0.04},
    "d0.1": {"density": 0.1},
    "replicated": {"sharded": False},
    # The int8 wire: at the defaults, and at the density whose sparse steps send what fp32 sends at d = 0.01.
    "int8": {"wire_format": "int8"},
    "int8_d0.025": {"wire_format": "int8", "density": 0.025},
    # The int8 wire with every step dense: 8-bit gradients with error feedback, no sparsity.
    "int8_dense": {"wire_format": "int8", "dense_warmup_steps": 10**9},
    # The int8 wire at d = 0.025 with a shorter density ramp (its dense steps cost a quarter of fp32's).
    "int8_d0.025_r200": {"wire_format": "int8", "density": 0.025, "density_ramp_steps": 200},
    "int8_d0.025_r100": {"wire_format": "int8", "density": 0.025, "density_ramp_steps": 100},
    # The mask of the form chosen on a slow link: the raw-gradient statistic, and exploration 0 and 0.3.
    "int8_d0.025_gradient_stat": {"wire_format": "int8", "density": 0.025},
    "int8_d0.025_explore0": {"wire_format": "int8", "density": 0.025, "exploration": 0.0},
    "int8_d0.025_explore0.3": {"wire_format": "int8", "density": 0.025, "exploration": 0.3},
    # The raw-gradient statistic for the first N sparse steps, the first-moment statistic after: see GRADIENT_FIRST.
    "int8_d0.025_gradient_first100": {"wire_format": "int8", "density": 0.025},
    "int8_d0.025_gradient_first300": {"wire_format": "int8", "density": 0.025},
    # The package's defaults (SCAPE chooses the form), with the link its pilot measures read as 100 Mbit/s
    # (the simulated ranks' own link is memory): the form a run on that link takes, and its quality.
    "auto_100mbit": {"density": None},
    # The defaults on a link read as 1 Gbit/s until step 300, 100 Mbit/s after: sparse steps chosen mid-run, after
    # dense ones; with the ramp's dense steps skipped (as the pilot does) and, for comparison, the whole ramp again.
    "auto_1gbit_then_100mbit": {"density": None},
    "auto_1gbit_then_100mbit_whole_ramp": {"density": None},
    # The learning rate of the sparse steps (the package has no such option; the benchmark scales the cosine).
    "sparse_lr1.5": _W100_R200,
    "sparse_lr2": _W100_R200,
}
# Configurations whose learning rate the benchmark multiplies by this factor in the sparse steps (after the
# dense steps of the schedule): does the sparse phase want a larger step than dense AdamS's tuned one?
SPARSE_LR_SCALE: dict[str, float] = {"sparse_lr1.5": 1.5, "sparse_lr2": 2.0}
# The tables of docs/benchmarks.md: (configurations, corpora, steps, seeds, model preset, batch per rank). Runs
# that several tables share (dense and default at 1000 steps) are trained once: the runs file holds them.
_STD = (["stdlib"], 1000, [0], "small", 16)
# The default (30 + 400) is the table's "default" row.
_SCHEDULES = ["w100_r0", "w100_r100", "w100_r200", "w100_r400", "w50_r200", "w200_r200",
              "w50_r300"]  # fmt: skip
TABLES: dict[str, list[tuple[list[str], list[str], int, list[int], str, int]]] = {
    "headline": [([DENSE, "default"], ["stdlib", "prose"], 1000, [0, 1], "small", 16)],
    "horizons": [([DENSE, "default"], ["stdlib", "prose"], 300, [0, 1], "small", 16)],
    "long": [([DENSE, "default"], ["stdlib", "prose"], 3000, [0], "small", 16)],
    "schedule": [([DENSE, "default", *_SCHEDULES], *_STD)],
    "catch_up": [([DENSE, "w100_r200", "no_cap", "cap8", "cap16", "cap64"], *_STD)],
    "sparse_lr": [([DENSE, "w100_r200", "sparse_lr1.5", "sparse_lr2"], *_STD)],
    "mask": [([DENSE, "default", "gradient_stat", "explore0", "explore0.3", "replicated"], *_STD)],
    "density": [([DENSE, "default", "d0.02", "d0.04", "d0.1"], *_STD)],
    "mask_int8": [
        (
            [DENSE, "int8_d0.025", "int8_d0.025_gradient_stat", "int8_d0.025_explore0", "int8_d0.025_explore0.3"],
            ["stdlib"],
            1000,
            [0, 1],
            "small",
            16,
        )
    ],
    "mask_switch": [
        (
            [
                DENSE,
                "int8_d0.025",
                "int8_d0.025_gradient_stat",
                "int8_d0.025_gradient_first100",
                "int8_d0.025_gradient_first300",
            ],
            ["stdlib", "prose"],
            1000,
            [0, 1],
            "small",
            16,
        )
    ],
    "wire": [([DENSE, "default", "int8", "int8_d0.025", "int8_dense"], ["stdlib", "prose"], 1000, [0, 1], "small", 16)],
    "scale": [
        ([DENSE, "default"], ["stdlib"], 1000, [0], "base", 16),
        ([DENSE, "default"], ["stdlib"], 1000, [0], "small", 64),
    ],
}


@dataclass(frozen=True)
class Run:
    """One training run: a configuration on a corpus for a number of steps, with a seed."""

    config: str
    corpus: str
    steps: int
    seed: int
    model: str = "small"
    batch: int = 16

    @property
    def key(self) -> str:
        return f"{self.config}|{self.corpus}|{self.steps}|{self.seed}|{self.model}|{self.batch}"

    def dense_twin(self) -> Run:
        return Run(DENSE, self.corpus, self.steps, self.seed, self.model, self.batch)


def scape_config(name: str) -> ScapeConfig:
    """The configuration a name stands for (unknown names raise with the list of known ones)."""
    if name not in CONFIGS:
        raise SystemExit(f"unknown configuration {name!r}; choose from {sorted(CONFIGS)}")
    return ScapeConfig(**{"density": 0.01, **CONFIGS[name]})  # the fixed form of the package's former defaults


# Configurations whose masks score the raw gradient with its residual, |e| (top-k with error feedback: the baseline
# the paper compares its first-moment masks with), instead of the package's |b1*m + (1-b1)*e|.
GRADIENT_STATISTIC = frozenset({"gradient_stat", "int8_d0.025_gradient_stat"})
# Configurations whose first N sparse steps use masks of the raw-gradient statistic, and every later one masks of the
# first-moment statistic (the benchmark switches ``engine.masks.statistic``; the package has no such option).
GRADIENT_FIRST: dict[str, int] = {"int8_d0.025_gradient_first100": 100, "int8_d0.025_gradient_first300": 300}

# The links the form pilot of an "auto_*" configuration reads instead of timing its probes (bits per second).
# The link from each step on: ``{0: link}`` for a link that does not change.
_SLOW_LINK, _FAST_LINK = Link(95e6, 50e-6, 1.0), Link(950e6, 50e-6, 1.0)
GIVEN_LINKS: dict[str, dict[int, Link]] = {
    "auto_100mbit": {0: _SLOW_LINK},
    "auto_1gbit_then_100mbit": {0: _FAST_LINK, 300: _SLOW_LINK},
    "auto_1gbit_then_100mbit_whole_ramp": {0: _FAST_LINK, 300: _SLOW_LINK},
}


# The compute an "auto_*" configuration's pilot reads: a step of the small model on the 2-core VM in the
# time-to-loss benchmark (its fp32 dense steps at 10 Gbit/s), so that its decisions do not depend on the load of the
# machine (the simulated ranks share it).
GIVEN_COMPUTE_S = 0.09


class GivenLinkPilot(FormPilot):
    """The package's form pilot, its probes sent but their times those of ``links`` (the link from each step on),
    and every form's compute :data:`GIVEN_COMPUTE_S`. ``whole_ramp``: a sparse form chosen after dense steps runs its
    whole density ramp."""

    def __init__(self, links: dict[int, Link], whole_ramp: bool = False) -> None:
        super().__init__(on_decision=lambda decision: None)
        self.links = links
        self.whole_ramp = whole_ramp

    def _compute(self, samples: list[float]) -> float:
        return GIVEN_COMPUTE_S

    def _step_time(self, samples: list[float]) -> float | None:
        return None  # the simulated ranks' link is memory: the form in use is predicted at the given link too

    def _recent_step(self, engine: ScapeEngine) -> float | None:
        return None  # no watch on the wall-clock: the decisions come from the given links only

    def _dense_since(self, base: ScapeConfig) -> int | None:
        return None if self.whole_ramp else super()._dense_since(base)

    def _probe_times(self, engine: ScapeEngine) -> tuple[float, int, float]:
        for numel in (PROBE_SMALL_NUMEL, PROBE_LARGE_NUMEL):  # sent, not timed
            timed_gather(engine, numel)
        link = self.links[max(step for step in self.links if step <= engine.step_count)]
        cluster = Cluster(engine.world_size, 1, link)
        small, large = (Collective("all_gather", "probe", n, 4) for n in (PROBE_SMALL_NUMEL, PROBE_LARGE_NUMEL))
        return cluster.seconds(small), PROBE_LARGE_NUMEL, cluster.seconds(large)


def eval_every(steps: int) -> int:
    """Twenty to thirty points per curve."""
    return 10 if steps <= 300 else 50 if steps <= 1000 else 100


def train(rank: int, comm: Communicator, run: Run, tokens: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One simulated rank's run; every rank returns its losses, rank 0's record holds the curves."""
    torch.set_num_threads(1)
    train_tokens, val_tokens = tokens
    model = build_model(BLOCK, preset=run.model, seed=run.seed)
    opt = adams_optimizer(model, PEAK_LR)
    config = scape_config(run.config)
    link = GIVEN_LINKS.get(run.config)
    pilot = None if link is None else GivenLinkPilot(link, whole_ramp=run.config.endswith("_whole_ramp"))
    engine = ScapeEngine(opt, config, comm, list(model.parameters()), form_pilot=pilot)
    if run.config in GRADIENT_STATISTIC or run.config in GRADIENT_FIRST:
        engine.masks.statistic = "gradient"
    # The mask of step t + 1 is built at the end of step t (mask_delay=1): switching before step dense_steps + N
    # leaves the raw-gradient masks to sparse steps dense_steps + 1 ... dense_steps + N.
    switch_at = config.dense_steps + GRADIENT_FIRST[run.config] if run.config in GRADIENT_FIRST else None
    lr_scale = SPARSE_LR_SCALE.get(run.config, 1.0)
    sparse_from = config.dense_steps if lr_scale != 1.0 else run.steps
    gen = torch.Generator().manual_seed(1234 + rank + 1000 * run.seed)
    losses, step_bytes, curve = [], [], []
    every = eval_every(run.steps)
    for step in range(run.steps):
        set_cosine_lr(opt, step, run.steps, PEAK_LR * (lr_scale if step >= sparse_from else 1.0))
        if step + 1 == switch_at:
            engine.masks.statistic = "momentum"
        x, y = sample_batch(train_tokens, gen, run.batch, BLOCK)
        loss = lm_loss(model, x, y)
        loss.backward()
        engine.step(max_grad_norm=CLIP)
        engine.zero_grad()
        losses.append(float(loss.detach()))
        step_bytes.append(engine.counters.step_sent_bytes)
        done = step + 1
        if done % every == 0 or done == run.steps:
            model.eval()
            val = validation_loss(model, val_tokens, BLOCK, EVAL_BATCHES)
            model.train()
            curve.append((done, val, engine.counters.total_sent_bytes))
    record = {
        "decisions": [] if pilot is None else [(d.step, d.chosen.name, d.describe()) for d in pilot.decisions],
        "losses": losses,
        "curve": curve,
        "step_bytes": step_bytes,
        "dense_equivalent_per_step": engine.counters.total_dense_equivalent / run.steps,
    }
    engine.close()
    return record


def run_one(run: Run, tokens: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Train ``run`` on W simulated ranks; the record written to ``runs.jsonl``."""
    t0 = time.perf_counter()
    per_rank = simulate(WORLD_SIZE, lambda rank, comm: train(rank, comm, run, tokens))
    rank0 = per_rank[0]
    train_loss = [sum(x) / WORLD_SIZE for x in zip(*(r["losses"] for r in per_rank), strict=True)]
    cfg = scape_config(run.config)
    return {
        **asdict(run),
        "scape_config": cfg.to_dict(),
        "curve": rank0["curve"],
        "train_loss": train_loss,
        "step_bytes": rank0["step_bytes"],
        "dense_equivalent_per_step": rank0["dense_equivalent_per_step"],
        "decisions": rank0["decisions"],
        "seconds": time.perf_counter() - t0,
    }


def load_runs(path: str) -> dict[str, dict[str, Any]]:
    """The finished runs of ``runs.jsonl`` by key."""
    out: dict[str, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[Run(**{k: rec[k] for k in Run.__dataclass_fields__}).key] = rec
    return out


def planned(table: str | None, args: argparse.Namespace) -> list[Run]:
    """The runs of a table, or of the command line's configurations, corpora, steps and seeds."""
    specs = TABLES[table] if table else [
        (args.configs.split(","), args.corpora.split(","), args.steps, [int(s) for s in args.seeds.split(",")],
         args.model, args.batch)
    ]  # fmt: skip
    runs: list[Run] = []
    for configs, corpora, steps, seeds, model, batch in specs:
        for corpus in corpora:
            if corpus not in CORPORA:
                raise SystemExit(f"unknown corpus {corpus!r}; choose from {list(CORPORA)}")
            for seed in seeds:
                for name in [DENSE] + [c for c in configs if c != DENSE]:  # the baseline of each seed first
                    scape_config(name)
                    runs.append(Run(name, corpus, steps, seed, model, batch))
    return runs


# ------------------------------------------------------------------------------------------------ report


def sparse_phase_bytes(rec: dict[str, Any]) -> float:
    """Mean bytes of the steps at the final density (after the dense warm-up and the density ramp)."""
    cfg = ScapeConfig.from_dict(rec["scape_config"])
    warmup = max(cfg.dense_warmup_steps, MIN_MEASURED_STEPS) if cfg.chooses_form else cfg.dense_warmup_steps
    first = warmup + max(cfg.density_ramp_steps, 1)
    tail = rec["step_bytes"][first:] or rec["step_bytes"]
    return sum(tail) / len(tail)


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f}" + (f" ± {statistics.pstdev(values):.4f}" if len(values) > 1 else "")


def table_rows(runs: Iterable[Run], done: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: one per (configuration, corpus, steps, model, batch), seeds pooled."""
    groups: dict[tuple[str, str, int, str, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.config, run.corpus, run.steps, run.model, run.batch), []).append(run)
    rows = []
    for (name, corpus, steps, model, batch), members in groups.items():
        recs = [done[r.key] for r in members if r.key in done and r.dense_twin().key in done]
        if not recs:
            continue
        dense = [done[Run(**{k: rec[k] for k in Run.__dataclass_fields__}).dense_twin().key] for rec in recs]
        vals = [rec["curve"][-1][1] for rec in recs]
        ratios = [v / d["curve"][-1][1] for v, d in zip(vals, dense, strict=True)]
        ddp = [rec["dense_equivalent_per_step"] for rec in recs]
        whole = [rec["curve"][-1][2] / (d * steps) for rec, d in zip(recs, ddp, strict=True)]
        sparse = [sparse_phase_bytes(rec) / d for rec, d in zip(recs, ddp, strict=True)]
        rows.append(
            f"| {name} | {corpus} | {model} | {batch} | {steps} | {len(recs)} | {_spread(vals)} | "
            f"{_spread(ratios)} | {statistics.mean(whole):.4f} | 1/{1 / statistics.mean(sparse):.0f} |"
        )
    return rows


HEADER = [
    "| configuration | corpus | model | batch/rank | steps | seeds | val loss | vs dense | bytes vs DDP (run) "
    "| bytes vs DDP (sparse step) |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def write_report(out: str, done: dict[str, dict[str, Any]]) -> str:
    """``quality.md`` (one table per table of :data:`TABLES` with finished runs), ``curves.csv`` and the plots."""
    lines = [
        f"W = {WORLD_SIZE} (simulated), 128-byte sequences, AdamS, cosine LR peak {PEAK_LR}, clip {CLIP}; "
        "'vs dense': final validation loss over DDP + AdamS's with the same seed (mean ± spread over seeds); "
        "bytes: rank 0's, over what DDP's all-reduce of the same gradients sends.",
    ]
    in_tables: set[str] = set()
    for name in TABLES:
        runs = planned(name, argparse.Namespace())
        new = any(r.key in done and r.key not in in_tables for r in runs)  # not only rows shown above
        in_tables.update(r.key for r in runs)
        rows = table_rows(runs, done)
        if rows and new:
            lines += ["", f"### {name} (`python benchmarks/quality.py --table {name}`)", "", *HEADER, *rows]
    others = [Run(**{k: rec[k] for k in Run.__dataclass_fields__}) for key, rec in done.items() if key not in in_tables]
    rows = table_rows(others, done)
    if rows:
        lines += ["", "### other runs", "", *HEADER, *rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "quality.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "curves.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["configuration", "corpus", "model", "batch", "steps", "seed", "step", "val_loss", "bytes_sent"])
        for rec in done.values():
            for step, val, sent in rec["curve"]:
                w.writerow([rec["config"], rec["corpus"], rec["model"], rec["batch"], rec["steps"], rec["seed"],
                            step, f"{val:.5f}", sent])  # fmt: skip
    plot(out, done)
    return text


def plot(out: str, done: dict[str, dict[str, Any]]) -> None:
    """Validation loss against step and against cumulative bytes: ``<table>_<corpus>_<steps>[...].png``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
        return
    for table in TABLES:
        figures: dict[tuple[str, int, str, int], list[dict[str, Any]]] = {}
        for run in planned(table, argparse.Namespace()):
            if run.key in done:
                figures.setdefault((run.corpus, run.steps, run.model, run.batch), []).append(done[run.key])
        for (corpus, steps, model, batch), recs in figures.items():
            fig = Figure(figsize=(13, 4.8), layout="constrained")
            by_step, by_bytes = fig.subplots(1, 2)
            names = list(dict.fromkeys(r["config"] for r in recs))
            colors = {n: f"C{i}" for i, n in enumerate(names)}
            for rec in recs:
                steps_, vals, sent = zip(*rec["curve"], strict=True)
                style = {"color": colors[rec["config"]], "lw": 2.2 if rec["config"] == DENSE else 1.2,
                         "ls": "-" if rec["seed"] == 0 else "--"}  # fmt: skip
                label = f"{rec['config']} (seed {rec['seed']})"
                by_step.plot(steps_, vals, label=label, **style)
                by_bytes.plot(sent, vals, label=label, **style)
            scale = "" if (model, batch) == ("small", 16) else f", {model}, {batch}/rank"
            title = f"{table}: {corpus}, {steps} steps{scale}"
            by_step.set(xlabel="step", ylabel="validation loss (nats/byte)", title=title)
            by_bytes.set(xlabel="bytes sent by rank 0 (cumulative)", xscale="log", title="against bytes sent")
            for ax in (by_step, by_bytes):
                ax.grid(alpha=0.3)
            by_step.legend(fontsize=7)
            suffix = "" if (model, batch) == ("small", 16) else f"_{model}_b{batch}"
            fig.savefig(os.path.join(out, f"{table}_{corpus}_{steps}{suffix}.png"), dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=sorted(TABLES), help="run one table of docs/benchmarks.md")
    ap.add_argument("--configs", default="dense,default", help=f"comma-separated, from {sorted(CONFIGS)}")
    ap.add_argument("--corpora", default="stdlib", help=f"comma-separated, from {list(CORPORA)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--model", default="small", help="a preset of lightning_scape.examples.workloads.MODEL_PRESETS")
    ap.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    ap.add_argument("--out", default="out/quality")
    ap.add_argument("--report", action="store_true", help="only rewrite the report from OUT/runs.jsonl")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "runs.jsonl")
    done = load_runs(path)
    if not args.report:
        tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for run in planned(args.table, args):
            if run.key in done:
                continue
            if run.corpus not in tokens:  # read once: the simulated ranks are threads sharing the tokens
                tokens[run.corpus] = corpus_tokens(run.corpus)  # type: ignore[arg-type]
            rec = run_one(run, tokens[run.corpus])
            done[run.key] = rec
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            ratio = ""
            twin = done.get(run.dense_twin().key)
            if twin is not None and run.config != DENSE:
                ratio = f", {rec['curve'][-1][1] / twin['curve'][-1][1]:.4f} x dense"
            print(f"{run.key}: val {rec['curve'][-1][1]:.4f}{ratio} ({rec['seconds']:.0f} s)", flush=True)
    print(write_report(args.out, done))


if __name__ == "__main__":
    main()
