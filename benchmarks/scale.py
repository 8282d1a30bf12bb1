"""SCAPE's quality at a size users train, on one GPU: a 110M-parameter litgpt model, two ranks, three methods.

    python -m benchmarks.scale                   # on a CUDA GPU: sized to end within 8 minutes (--budget-s 480)
    python -m benchmarks.scale --budget-s 300    # a shorter budget: a smaller batch, the same 1000 steps
    python -m benchmarks.scale --tiny            # no GPU: the same code path on the CPU (a small model, 12 steps)
    python -m benchmarks.gpu_check               # the kernel check first, then this run (about 13 minutes in all)

**What it trains.** litgpt's ``pythia-160m`` configuration (12 layers, 768 wide) with a 16,384-token BPE
embedding: 110.2M parameters. The text is this interpreter's own Python sources (the standard library's and the
installed packages' ``.py`` files, a deterministic sample of up to 64 MB, copied into the cache once:
:func:`python_sources`), split by file and tokenized by ``TextFolder``'s BPE; nothing is downloaded. The
standard library alone (``--corpus stdlib``) is 2.9M BPE tokens, which this run would read about ten times. Two
data-parallel ranks share the one GPU (``lightning_scape.simulate``: threads with in-memory collectives, the exact
two-rank algorithm), bf16 autocast with fp32 parameters, AdamS (peak learning rate 6e-4, the Pythia paper's for
this size; weight decay 0.1 on the matrices), a cosine schedule with a 5% linear warm-up, clipping at 1.0. Every
method starts from the same weights and sees the same batches:

- ``ddp_adams``: DDP + AdamS, every gradient all-reduced every step (SCAPE's engine held dense: the yardstick);
- ``scape_fp32_d0.01``: SCAPE at fp32 and d = 0.01 (the former default form; the rest of the package's defaults);
- ``scape_int8_d0.025``: the int8 wire at d = 0.025;
- ``scape_auto_100mbit``: the package's defaults, whose form pilot reads a 100 Mbit/s link (the link of
  ``benchmarks/quality.py``'s ``auto_100mbit``; the simulated ranks' own link is memory) and chooses the form a user
  on such a link gets;

by default all but the second (``--methods`` names the runs; the fp32 wire at d = 0.01 is the form of the
package's CPU quality figures, run here once before).

The schedules scale with the run: at 1000 steps (the default) SCAPE's are exactly the package's defaults (30 dense
warm-up steps, a 400-step density ramp), the ones ``docs/algorithm.md`` section 7 measured on the small model.

**How it fits the budget.** Before training it tokenizes the text, compiles every Triton kernel variant the runs
will launch (a dry run of each SCAPE engine through its schedule, without the model's forward and backward), and
probes the step: DDP + AdamS at two batch sizes (the time per sequence and the time that does not grow with the
batch), each SCAPE method's sparse step, one validation pass, the set-up and the peak memory. From those and the
time left it picks the largest batch per rank (sequences of 1024 tokens) at which the runs end within 85% of
the budget, that reads the training text at most twice (``--max-epochs``) and fits in 90% of the GPU's memory.
Before each run it checks the time left against the runs before it, and skips a run that would end past the budget.

**What it writes** under ``--out`` (rewritten after every run, so a run stopped early leaves what it finished):
``report.md`` (the sizing, the final validation loss of each method and its ratio to DDP + AdamS, the bytes each
sent against DDP's, tokens/s, peak memory), ``curves.csv`` (validation loss and bytes at every evaluation),
``steps.csv`` (train loss and bytes sent at every step), ``scale.png`` (validation loss and bytes sent per step
against the step) and ``results.json`` (all of it). Bytes are the engine's counts of what each rank's ring
collectives send (``docs/algorithm.md`` section 5); tokens/s is the two ranks together on one GPU, and so is the
peak memory: neither is a two-GPU figure. ``--tiny`` runs every part on the CPU with the references, at a size
that takes seconds (``tests/test_scale.py``): a test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks import reporting
from benchmarks.cpu_fallback import cpu_fallback
from benchmarks.quality import CLIP, GIVEN_LINKS, GivenLinkPilot, scape_config
from lightning_scape import ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.examples.workloads import adams_optimizer, lm_loss, sample_batch, set_cosine_lr
from lightning_scape.litgpt.data import STDLIB_EXCLUDED_DIRS, TextFolder, default_cache_dir, stdlib_root

# The methods, each a configuration of benchmarks/quality.py (its names) and the label the report gives it.
METHODS: dict[str, str] = {
    "ddp_adams": "dense",
    "scape_fp32_d0.01": "default",
    "scape_int8_d0.025": "int8_d0.025",
    "scape_auto_100mbit": "auto_100mbit",
}
LABELS: dict[str, str] = {
    "ddp_adams": "DDP + AdamS",
    "scape_fp32_d0.01": "SCAPE fp32 wire, d = 0.01",
    "scape_int8_d0.025": "SCAPE int8 wire, d = 0.025",
    "scape_auto_100mbit": "SCAPE defaults at 100 Mbit/s",
}
# What a run measures unless --methods says otherwise: the yardstick, the package's best fixed sparse form, and
# what the defaults do on a slow link (the fp32 wire at d = 0.01, the form of the CPU figures, on request).
DEFAULT_METHODS = ("ddp_adams", "scape_int8_d0.025", "scape_auto_100mbit")
# The fixed form a method whose pilot chooses its form is probed as: the one it chose on every model measured at
# that link (docs/benchmarks.md, "AdamW converted to AdamS"), since the probe's few steps end before a decision.
PROBED_AS: dict[str, str] = {"scape_auto_100mbit": "scape_int8_d0.025"}
BASELINE = "ddp_adams"
# The run length at which SCAPE's schedule is the package's default (30 dense warm-up steps, a 400-step ramp),
# and quality.py's tables were measured: other lengths scale the schedule by steps / REFERENCE_STEPS.
REFERENCE_STEPS = 1000
# The runs must end within this share of the time left when they are planned (the rest absorbs what the
# probe did not see), and the batch leaves this share of the GPU's memory unused.
TIME_SAFETY = 0.85
MEMORY_SHARE = 0.9
# Steps of each probe run, of which the first PROBE_SKIP are not timed (allocations, the first sparse steps).
PROBE_STEPS = 6
PROBE_SKIP = 2
# Below this many steps a run says little about SCAPE (its schedule would be a few steps long): refuse.
MIN_STEPS = 100
# Seconds kept for the report and the plot after the last run.
REPORT_S = 10.0
# Windows of the fixed validation batches.
VAL_WINDOWS = 16
CORPUS_FORMAT_VERSION = 1  # bump when python_sources' selection or layout changes


@dataclass(frozen=True)
class Size:
    """What the command trains; the batch per rank is sized from the probe unless ``batch`` is given."""

    model: str  # a litgpt configuration name
    overrides: tuple[tuple[str, int], ...]  # fields of that configuration replaced (the tiny model)
    vocab_size: int  # of the BPE, and the model's (padded) vocabulary
    block_size: int
    steps: int
    world_size: int  # simulated ranks on the one device
    precision: str  # "bf16-mixed" (bf16 autocast, fp32 parameters) or "32-true"
    peak_lr: float
    lr_warmup_fraction: float
    evals: int  # validation points per run
    eval_batches: int  # of VAL_WINDOWS windows each
    corpus: str  # "python", "stdlib", or a folder
    max_bytes: int | None
    val_fraction: float
    max_epochs: float
    probe_batches: tuple[int, int]
    max_batch: int
    batch: int | None = None  # given: no sizing
    seed: int = 0


FULL = Size(
    model="pythia-160m",
    overrides=(),
    vocab_size=16384,
    block_size=1024,
    steps=REFERENCE_STEPS,
    world_size=2,
    precision="bf16-mixed",
    peak_lr=6e-4,
    lr_warmup_fraction=0.05,
    evals=20,
    eval_batches=8,
    corpus="python",
    max_bytes=64_000_000,
    val_fraction=0.02,
    max_epochs=2.0,
    probe_batches=(4, 8),
    max_batch=32,
)
# The same code path in seconds on two CPU cores: a 2-layer, 64-wide model, a 512-token BPE of 300 kB of the
# standard library, 12 steps of 2 x 32 tokens per rank (its schedule: 1 dense warm-up step, a 5-step ramp).
TINY = Size(
    model="pythia-14m",
    overrides=(("n_layer", 2), ("n_embd", 64), ("n_head", 4), ("intermediate_size", 256)),
    vocab_size=512,
    block_size=32,
    steps=12,
    world_size=2,
    precision="32-true",
    peak_lr=3e-3,
    lr_warmup_fraction=0.05,
    evals=3,
    eval_batches=2,
    corpus="stdlib",
    max_bytes=300_000,
    val_fraction=0.05,
    max_epochs=1e9,
    probe_batches=(1, 2),
    max_batch=4,
    batch=2,
)


@dataclass(frozen=True)
class RunSpec:
    """One training run of one method (``probe``: time every step, validate once at the end)."""

    method: str
    config: ScapeConfig
    steps: int
    batch: int
    probe: bool = False


@dataclass
class Shared:
    """What the simulated ranks of every run read: the initial model, the tokens, the validation batches."""

    size: Size
    device: torch.device
    base: torch.nn.Module  # on the CPU: each rank of each run trains a copy
    train: Tensor
    val_batches: list[tuple[Tensor, Tensor]]


# ------------------------------------------------------------------------------------------------ the data


def python_sources(max_bytes: int | None, cache_dir: Path | None = None, roots: dict[str, Path] | None = None) -> Path:
    """A folder of this interpreter's Python sources, copied into the cache once and reused.

    The standard library's ``.py`` files (``stdlib/...``) and the installed packages' (``site-packages/...``),
    hidden entries and the ``test``/``tests`` folders left out. When they hold more than ``max_bytes``, a sample
    of whole files chosen by a hash of their path (so every package is represented, and the same files on every
    run of the same environment) up to ``max_bytes``.

    Args:
        max_bytes: The most bytes to copy (None: all).
        cache_dir: The parent of the ``corpora`` folder (default: ``TextFolder``'s cache).
        roots: The folders to read, by the name of their subfolder in the result (default: ``stdlib`` and
            ``site-packages``).

    Returns:
        The folder, for ``TextFolder(path=...)``.
    """
    if roots is None:
        roots = {"stdlib": stdlib_root(), "site-packages": Path(sysconfig.get_paths()["purelib"])}
    files: list[tuple[str, Path, int, int]] = []
    for name, root in roots.items():
        if not root.is_dir():
            continue
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in STDLIB_EXCLUDED_DIRS)
            for file in sorted(names):
                path = Path(dirpath) / file
                if file.endswith(".py") and not file.startswith(".") and path.is_file():
                    st = path.stat()
                    files.append((f"{name}/{path.relative_to(root).as_posix()}", path, st.st_size, st.st_mtime_ns))
    files = _sample(files, max_bytes)
    key = json.dumps([CORPUS_FORMAT_VERSION, max_bytes, [(rel, size, mtime) for rel, _, size, mtime in files]])
    parent = (cache_dir if cache_dir is not None else default_cache_dir()) / "corpora"
    folder = parent / f"python-sources-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (folder / ".manifest.json").is_file():
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=parent))
    try:
        for rel, path, _, _ in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, tmp / rel)
        manifest = {"files": len(files), "bytes": sum(f[2] for f in files), "python": sys.version}
        (tmp / ".manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")  # hidden: TextFolder skips it
        try:
            os.rename(tmp, folder)
        except OSError:  # another process renamed its identical folder into place first
            if not (folder / ".manifest.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _sample(files: list[tuple[str, Path, int, int]], max_bytes: int | None) -> list[tuple[str, Path, int, int]]:
    """Whole files in the order of a hash of their path until ``max_bytes``; returned sorted by path."""
    if max_bytes is None or sum(f[2] for f in files) <= max_bytes:
        return files
    kept, total = [], 0
    for f in sorted(files, key=lambda f: hashlib.sha1(f[0].encode("utf-8", "surrogateescape")).digest()):
        if total + f[2] <= max_bytes:
            kept.append(f)
            total += f[2]
    return sorted(kept)


def load_corpus(size: Size, cache_dir: Path | None) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """The (train, validation) BPE tokens of the run's text, and what they are."""
    t0 = time.perf_counter()
    if size.corpus == "python":
        path: Path | None = python_sources(size.max_bytes, cache_dir)
        max_bytes = None  # the folder is already the sample
    else:
        path = None if size.corpus == "stdlib" else Path(size.corpus)
        max_bytes = size.max_bytes
    data = TextFolder(path, tokenizer="bpe", vocab_size=size.vocab_size, val_fraction=size.val_fraction,
                      max_bytes=max_bytes, cache_dir=cache_dir)  # fmt: skip
    train, val = data.token_splits()
    assert data.tokenizer_path is not None  # a BPE's cache entry: tokenizer.json beside meta.json
    meta = json.loads((data.tokenizer_path.parent / "meta.json").read_text())
    info = {
        "corpus": size.corpus,
        "path": str(path) if path is not None else "the standard library's sources",
        "files": meta["files"],
        "bytes": meta["bytes"],
        "split": meta["split"],
        "train_tokens": len(train),
        "val_tokens": len(val),
        "vocab_size": meta["vocab_size"],
        "seconds": time.perf_counter() - t0,
    }
    return train, val, info


def validation_batches(val: Tensor, size: Size, device: torch.device) -> list[tuple[Tensor, Tensor]]:
    """Fixed validation windows (seeded), on the device: every evaluation of every run reads the same ones."""
    gen = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(size.eval_batches):
        x, y = sample_batch(val, gen, VAL_WINDOWS, size.block_size)
        batches.append((x.to(device), y.to(device)))
    return batches


# ------------------------------------------------------------------------------------------------ the model


def model_config(size: Size) -> Any:
    """The litgpt ``Config``: the named configuration with the BPE's vocabulary and the run's block size."""
    from litgpt import Config

    return Config.from_name(size.model, block_size=size.block_size, vocab_size=size.vocab_size,
                            padded_vocab_size=size.vocab_size, **dict(size.overrides))  # fmt: skip


def base_model(size: Size) -> torch.nn.Module:
    """The initial model on the CPU, from ``size.seed``: every rank of every run trains a copy of it."""
    from litgpt import GPT

    torch.manual_seed(size.seed)
    return GPT(model_config(size))


# ------------------------------------------------------------------------------------------------ a run


def method_config(method: str, steps: int) -> ScapeConfig:
    """The method's ``ScapeConfig`` with its dense warm-up and density ramp scaled to a run of ``steps``."""
    cfg = scape_config(METHODS[method])
    if method == BASELINE:
        return cfg
    scale = steps / REFERENCE_STEPS
    return dataclasses.replace(
        cfg,
        dense_warmup_steps=max(1, round(cfg.dense_warmup_steps * scale)),
        density_ramp_steps=round(cfg.density_ramp_steps * scale),
    )


def method_engine(
    method: str, config: ScapeConfig, opt: torch.optim.Optimizer, comm: Communicator, model: torch.nn.Module
) -> tuple[ScapeEngine, GivenLinkPilot | None]:
    """The method's engine over ``model``, and the form pilot that reads the method's given link, if it has one."""
    links = GIVEN_LINKS.get(METHODS[method])
    pilot = None if links is None else GivenLinkPilot(links)
    return ScapeEngine(opt, config, comm, list(model.parameters()), form_pilot=pilot), pilot


def lr_warmup_steps(steps: int, size: Size) -> int:
    """The linear learning-rate warm-up of a run of ``steps``."""
    return max(1, round(size.lr_warmup_fraction * steps))


def eval_every(steps: int, size: Size) -> int:
    """Steps between validations: ``size.evals`` points per run (and always the last step)."""
    return max(1, steps // size.evals)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(size: Size, device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=size.precision == "bf16-mixed")


@torch.no_grad()
def validation(model: torch.nn.Module, shared: Shared) -> float:
    """Mean loss over the fixed validation batches."""
    model.eval()
    losses = []
    for x, y in shared.val_batches:
        with _autocast(shared.size, shared.device):
            losses.append(lm_loss(model, x, y).float())
    model.train()
    return float(torch.stack(losses).mean())


def train_rank(rank: int, comm: Communicator, spec: RunSpec, shared: Shared) -> dict[str, Any]:
    """One simulated rank of one run; rank 0 validates (the replicas are equal) and times the run."""
    t0 = time.perf_counter()
    size, device = shared.size, shared.device
    if device.type == "cpu":
        torch.set_num_threads(1)  # two rank threads on two cores
    model = copy.deepcopy(shared.base).to(device)
    opt = adams_optimizer(model, size.peak_lr)
    engine, pilot = method_engine(spec.method, spec.config, opt, comm, model)
    gen = torch.Generator().manual_seed(1234 + rank + 1000 * size.seed)
    every, warm = eval_every(spec.steps, size), lr_warmup_steps(spec.steps, size)
    tokens_per_step = size.world_size * spec.batch * size.block_size
    losses: list[Tensor] = []
    step_bytes: list[int] = []
    step_s: list[float] = []
    curve: list[tuple[int, int, float, int, int]] = []
    segments: list[tuple[int, float]] = []  # (step at the end of a stretch of training, its seconds)
    _sync(device)
    setup_s = time.perf_counter() - t0
    eval_s = 0.0
    start = time.perf_counter()
    for step in range(spec.steps):
        t_step = time.perf_counter()
        set_cosine_lr(opt, step, spec.steps, size.peak_lr, warm)
        x, y = (t.to(device, non_blocking=True) for t in sample_batch(shared.train, gen, spec.batch, size.block_size))
        with _autocast(size, device):
            loss = lm_loss(model, x, y)
        loss.backward()
        engine.step(max_grad_norm=CLIP)
        engine.zero_grad()
        losses.append(loss.detach())
        step_bytes.append(engine.counters.step_sent_bytes)
        if spec.probe:
            _sync(device)
            step_s.append(time.perf_counter() - t_step)
        done = step + 1
        if rank == 0 and not spec.probe and (done % every == 0 or done == spec.steps):
            _sync(device)
            now = time.perf_counter()
            segments.append((done, now - start))
            val = validation(model, shared)
            c = engine.counters
            curve.append((done, done * tokens_per_step, val, c.total_sent_bytes, c.total_dense_equivalent))
            _sync(device)
            start = time.perf_counter()
            eval_s += start - now
    if rank == 0 and spec.probe:
        t_eval = time.perf_counter()
        validation(model, shared)
        eval_s = time.perf_counter() - t_eval
    record = {
        "losses": torch.stack(losses).float().cpu().tolist(),
        "step_bytes": step_bytes,
        "step_s": step_s,
        "curve": curve,
        "segments": segments,
        "setup_s": setup_s,
        "eval_s": eval_s,
        "dense_equivalent_per_step": engine.counters.total_dense_equivalent / spec.steps,
        "dense_steps": engine.config.dense_steps,  # of the form in use at the end (a pilot may have chosen it)
        "decisions": [] if pilot is None else [(d.step, d.chosen.name) for d in pilot.decisions],
    }
    engine.close()
    return record


# What a run's record takes from rank 0's (the other rank's are the same, or, for the curves, not computed).
RANK0_KEYS = (
    "step_bytes",
    "step_s",
    "curve",
    "segments",
    "eval_s",
    "dense_equivalent_per_step",
    "dense_steps",
    "decisions",
)


def run(spec: RunSpec, shared: Shared) -> dict[str, Any]:
    """Train ``spec`` on the simulated ranks; its record (rank 0's curves, the ranks' mean train loss)."""
    device = shared.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    ranks = simulate(shared.size.world_size, lambda rank, comm: train_rank(rank, comm, spec, shared), timeout_s=900)
    wall = time.perf_counter() - t0
    rank0 = ranks[0]
    record = {
        "method": spec.method,
        "label": LABELS[spec.method],
        "config": spec.config.to_dict(),
        "steps": spec.steps,
        "batch": spec.batch,
        "train_loss": [statistics.fmean(v) for v in zip(*(r["losses"] for r in ranks), strict=True)],
        **{k: rank0[k] for k in RANK0_KEYS},
        "setup_s": max(r["setup_s"] for r in ranks),
        "wall_s": wall,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    record.update(throughput(record, shared.size))
    return record


def throughput(record: dict[str, Any], size: Size) -> dict[str, float | None]:
    """Tokens/s over the stretches of training after the first (which holds the first steps' warm-up)."""
    segments = record["segments"]
    if len(segments) < 2:
        return {"tokens_per_s": None, "train_s": sum(s for _, s in segments)}
    steps = segments[-1][0] - segments[0][0]
    seconds = sum(s for _, s in segments[1:])
    tokens = steps * size.world_size * record["batch"] * size.block_size
    return {"tokens_per_s": tokens / seconds, "train_s": sum(s for _, s in segments)}


def warm_kernels(method: str, steps: int, shared: Shared) -> float:
    """Step a throwaway engine of ``method`` through its dense steps and density ramp, without forward or backward.

    Every Triton kernel variant the run will launch (the few the ramp's slot counts need: docs/kernels.md, "Compile
    time") is compiled here, before the step is probed and the run is timed; on the references (CPU) this only
    runs the schedule. Returns the seconds it took (``python -m benchmarks.compile_time`` times it alone).
    """
    cfg = method_config(method, steps)
    device = shared.device

    def worker(rank: int, comm: Communicator) -> None:
        model = copy.deepcopy(shared.base).to(device)
        engine, _ = method_engine(method, cfg, adams_optimizer(model, shared.size.peak_lr), comm, model)
        for _ in range(min(steps, cfg.dense_warmup_steps + cfg.density_ramp_steps + 2)):
            engine.step(max_grad_norm=CLIP)  # no backward: every bucket sends zeros
            engine.zero_grad()
        engine.close()

    t0 = time.perf_counter()
    simulate(shared.size.world_size, worker, timeout_s=900)
    _sync(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ sizing


@dataclass(frozen=True)
class Probe:
    """What the probe measured (seconds, bytes)."""

    batches: tuple[int, int]
    baseline_step_s: tuple[float, float]  # DDP + AdamS's step at the two batch sizes
    sparse_extra_s: dict[str, float]  # per SCAPE method: its sparse step less DDP + AdamS's, at batches[1]
    eval_s: float
    setup_s: float
    peak_bytes: dict[str, int]  # per method at batches[1]; the baseline at batches[0] as "<method>@<batch>"
    device_bytes: int | None

    def step_s(self, method: str, batch: int, sparse: bool) -> float:
        """Predicted seconds of one step: linear in the batch (DDP + AdamS's), plus the method's sparse extra."""
        (b1, b2), (t1, t2) = self.batches, self.baseline_step_s
        per_seq = max(0.0, (t2 - t1) / (b2 - b1))
        fixed = max(0.0, t2 - per_seq * b2)
        return fixed + per_seq * batch + (self.sparse_extra_s.get(method, 0.0) if sparse else 0.0)

    def max_batch_for_memory(self) -> int | None:
        """The largest batch per rank whose predicted peak memory fits :data:`MEMORY_SHARE` of the GPU's."""
        if self.device_bytes is None:
            return None
        b1, b2 = self.batches
        per_seq = max(1.0, (self.peak_bytes[BASELINE] - self.peak_bytes[f"{BASELINE}@{b1}"]) / (b2 - b1))
        fixed = max(self.peak_bytes.values()) - per_seq * b2
        return max(1, int((MEMORY_SHARE * self.device_bytes - fixed) // per_seq))


@dataclass(frozen=True)
class Plan:
    """The steps and batch per rank of the runs, what limited the batch, and the time predicted for them."""

    steps: int
    batch: int
    limit: str  # "time", "epochs", "memory", "max_batch" or "given"
    predicted_s: dict[str, float]


def predicted_run_s(probe: Probe, size: Size, method: str, steps: int, batch: int) -> float:
    """Predicted seconds of one run: set-up, validations, dense and sparse steps."""
    sparse = max(0, steps - method_config(PROBED_AS.get(method, method), steps).dense_steps)
    evals = math.ceil(steps / eval_every(steps, size))
    return (
        probe.setup_s
        + evals * probe.eval_s
        + (steps - sparse) * probe.step_s(method, batch, False)
        + sparse * probe.step_s(method, batch, True)
    )


def make_plan(probe: Probe, size: Size, methods: list[str], time_left_s: float, train_tokens: int, steps: int) -> Plan:
    """The largest batch per rank that fits the time, the epochs of text, the memory and ``size.max_batch``.

    Args:
        probe: The measured step.
        size: The run's shape (``size.batch`` given: no sizing).
        methods: The runs to fit.
        time_left_s: Seconds left for the runs.
        train_tokens: Tokens of the training split.
        steps: Steps per run; fewer when even one sequence per rank would not fit the time.

    Raises:
        SystemExit: Even ``MIN_STEPS`` steps of one sequence per rank do not fit.
    """

    def total(b: int, s: int) -> float:
        return sum(predicted_run_s(probe, size, m, s, b) for m in methods)

    budget = TIME_SAFETY * time_left_s
    tokens_per_seq = steps * size.world_size * size.block_size
    caps = {"max_batch": size.max_batch, "epochs": max(1, int(size.max_epochs * train_tokens // tokens_per_seq))}
    memory = probe.max_batch_for_memory()
    if memory is not None:
        caps["memory"] = memory
    if size.batch is not None:
        limit, batch = "given", size.batch
    else:
        limit, batch = min(caps.items(), key=lambda kv: kv[1])
        while batch > 1 and total(batch, steps) > budget:
            batch, limit = batch - 1, "time"
    while total(batch, steps) > budget and steps > MIN_STEPS and size.batch is None:
        steps, limit = max(MIN_STEPS, int(steps * 0.9)), "time"
    if total(batch, steps) > budget and size.batch is None:
        raise SystemExit(f"not enough time: {MIN_STEPS} steps of one sequence per rank for {len(methods)} methods "
                         f"are predicted to take {total(1, MIN_STEPS):.0f} s, {budget:.0f} s are left")  # fmt: skip
    return Plan(steps, batch, limit, {m: predicted_run_s(probe, size, m, steps, batch) for m in methods})


def probe_step(shared: Shared, methods: list[str], steps: int) -> Probe:
    """Time DDP + AdamS at the two probe batches and each SCAPE method's sparse step at the larger one."""
    b1, b2 = shared.size.probe_batches
    baseline, peaks, setups, eval_s = [], {}, [], 0.0
    for b in (b1, b2):
        rec = run(RunSpec(BASELINE, method_config(BASELINE, steps), PROBE_STEPS, b, probe=True), shared)
        baseline.append(statistics.median(rec["step_s"][PROBE_SKIP:]))
        peaks[BASELINE if b == b2 else f"{BASELINE}@{b}"] = rec["peak_memory_bytes"] or 0
        setups.append(rec["setup_s"])
        eval_s = max(eval_s, rec["eval_s"])
    extra = {}
    for m in methods:
        if m == BASELINE:
            continue
        # Two dense steps, then sparse at the method's density; the first sparse steps are not timed.
        probed = PROBED_AS.get(m, m)
        cfg = dataclasses.replace(method_config(probed, steps), dense_warmup_steps=2, density_ramp_steps=0)
        rec = run(RunSpec(probed, cfg, 2 + PROBE_STEPS, b2, probe=True), shared)
        extra[m] = statistics.median(rec["step_s"][2 + PROBE_SKIP :]) - baseline[1]
        peaks[m] = rec["peak_memory_bytes"] or 0
        setups.append(rec["setup_s"])
    device_bytes = None
    if shared.device.type == "cuda":
        # What this process can use: the free memory and what its allocator holds (another process, such as the
        # gpu_check that started this one, may hold some of the GPU).
        torch.cuda.empty_cache()
        device_bytes = torch.cuda.mem_get_info(shared.device)[0] + torch.cuda.memory_reserved(shared.device)
    return Probe((b1, b2), (baseline[0], baseline[1]), extra, eval_s, max(setups), peaks, device_bytes)


# ------------------------------------------------------------------------------------------------ results


def summary(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per finished run: final losses, their ratios to DDP + AdamS, bytes, tokens/s, memory."""
    base = records.get(BASELINE)
    rows = []
    for method, rec in records.items():
        final_val = rec["curve"][-1][2]
        tail = max(1, len(rec["train_loss"]) // 10)
        train = statistics.fmean(rec["train_loss"][-tail:])
        after = ScapeConfig.from_dict(rec["config"])
        first = after.dense_warmup_steps + after.density_ramp_steps if method != BASELINE else 0
        late = rec["step_bytes"][first:] or rec["step_bytes"]
        ddp_step = rec["dense_equivalent_per_step"]
        sent = rec["curve"][-1][3]
        row = {
            "method": method,
            "label": rec["label"],
            "forms": reporting.form_switches(rec.get("decisions", [])),
            "final_val_loss": final_val,
            "val_vs_ddp_adams": final_val / base["curve"][-1][2] if base else None,
            "train_loss_last_tenth": train,
            "train_vs_ddp_adams": train / statistics.fmean(base["train_loss"][-tail:]) if base else None,
            "bytes_per_step_after_ramp": statistics.fmean(late),
            "ddp_bytes_over_sent_after_ramp": ddp_step / max(1.0, statistics.fmean(late)),
            "sent_over_ddp_run": sent / max(1.0, ddp_step * rec["steps"]),
            "tokens_per_s": rec["tokens_per_s"],
            "peak_memory_gb": rec["peak_memory_bytes"] / 1e9 if rec["peak_memory_bytes"] else None,
            "train_s": rec["train_s"],
            "wall_s": rec["wall_s"],
        }
        rows.append(row)
    return rows


def report_md(results: dict[str, Any]) -> str:
    """``report.md``."""
    dev, data, plan, probe = results["device"], results["data"], results["plan"], results["probe"]
    size = results["size"]
    lines = [
        "# SCAPE at scale: quality on one GPU",
        "",
        f"Device: {dev['name']}, torch {dev['torch']}, triton {dev['triton']}, Python {dev['python']}. Command: "
        f"`{results['command']}`.",
    ]
    if not dev["cuda"]:
        lines += ["", "**No CUDA GPU: a tiny model on the CPU with the references. Nothing here is a measurement.**"]
    tokens_per_step = size["world_size"] * plan["batch"] * size["block_size"]
    epochs = plan["steps"] * tokens_per_step / data["train_tokens"]
    lines += [
        "",
        f"Model: litgpt `{size['model']}`{' with ' + str(dict(size['overrides'])) if size['overrides'] else ''}, "
        f"{results['parameters']:,} parameters, block {size['block_size']}, {size['precision']}. Text: "
        f"{data['path']} ({data['files']} files, {data['bytes'] / 1e6:.1f} MB), BPE {data['vocab_size']}: "
        f"{data['train_tokens']:,} train and {data['val_tokens']:,} validation tokens (tokenized in "
        f"{data['seconds']:.1f} s).",
        f"Runs: W = {size['world_size']} simulated ranks on the one device, {plan['steps']} steps of "
        f"{plan['batch']} x {size['block_size']} tokens per rank ({tokens_per_step:,} per step, "
        f"{plan['steps'] * tokens_per_step / 1e6:.1f}M per run, {epochs:.2f} epochs of the training text), AdamS "
        f"peak LR {size['peak_lr']} (cosine, {results['lr_warmup_steps']}-step warm-up), clip {CLIP}; validation "
        f"every {results['eval_every']} steps on {size['eval_batches'] * VAL_WINDOWS} fixed windows.",
        "",
        "## Sizing",
        "",
        f"Budget {results['budget_s']:.0f} s; before the runs {results['before_runs_s']:.0f} s went to the text, the "
        f"kernels' compilation ({', '.join(f'{m}: {s:.1f} s' for m, s in results['warm_s'].items()) or 'none'}) "
        "and the probe.",
        f"Probe: DDP + AdamS step {1e3 * probe['baseline_step_s'][0]:.1f} ms at batch {probe['batches'][0]}, "
        f"{1e3 * probe['baseline_step_s'][1]:.1f} ms at {probe['batches'][1]}; sparse step extra "
        + ", ".join(f"{m} {1e3 * s:+.1f} ms" for m, s in probe["sparse_extra_s"].items())
        + f"; validation {probe['eval_s']:.2f} s; set-up {probe['setup_s']:.1f} s per run.",
        f"Plan: batch {plan['batch']} per rank (limited by {plan['limit']}), {plan['steps']} steps; predicted "
        + ", ".join(f"{m} {s:.0f} s" for m, s in plan["predicted_s"].items())
        + "; measured "
        + ", ".join(f"{m} {r['wall_s']:.0f} s" for m, r in results["runs"].items())
        + ".",
    ]
    if results["skipped"]:
        lines.append(f"Not run (out of time): {', '.join(results['skipped'])}.")
    lines += [
        f"Whole command: {results['total_s']:.0f} s.",
        "",
        "## Results",
        "",
        "| method | final val loss | vs DDP + AdamS | train loss (last tenth) | vs DDP + AdamS | B sent/step after "
        "ramp | DDP bytes / sent, after ramp | sent / DDP, run | tokens/s | peak GB | train s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = reporting.fmt
    for r in results["summary"]:
        lines.append(
            f"| {r['label']} | {r['final_val_loss']:.4f} | {f(r['val_vs_ddp_adams'], '.4f')} | "
            f"{r['train_loss_last_tenth']:.4f} | {f(r['train_vs_ddp_adams'], '.4f')} | "
            f"{r['bytes_per_step_after_ramp']:,.0f} | {r['ddp_bytes_over_sent_after_ramp']:.1f}x | "
            f"{r['sent_over_ddp_run']:.3f} | {f(r['tokens_per_s'], ',.0f')} | {f(r['peak_memory_gb'], '.2f')} | "
            f"{r['train_s']:.0f} |"
        )
    lines += [
        "",
        "Losses in nats per BPE token; final val loss: the last evaluation. Bytes: what rank 0's ring collectives "
        "send (the engine's counters), against DDP's all-reduce of the same gradients. tokens/s and peak memory: "
        "both ranks together on one GPU (threads, in-memory collectives), evaluation and the first stretch of "
        "steps left out: not a two-GPU figure. The peak depends on whether the two ranks' forward passes coincide, "
        "and differs between runs of one method.",
    ]
    lines += [f"{r['label']}: the form pilot chose {r['forms']}." for r in results["summary"] if r["forms"]]
    return "\n".join(lines) + "\n"


def write_outputs(results: dict[str, Any], out: str) -> None:
    """``results.json``, ``curves.csv``, ``steps.csv``, ``report.md`` and ``scale.png`` under ``out``."""
    records = results["runs"]
    results["summary"] = summary(records) if records else []
    os.makedirs(out, exist_ok=True)
    reporting.write_json(results, out)
    curves, steps = [], []
    for method, rec in records.items():
        for step, tokens, val, sent, ddp in rec["curve"]:
            curves.append({"method": method, "step": step, "tokens": tokens, "val_loss": f"{val:.5f}",
                           "bytes_sent": sent, "ddp_bytes": ddp})  # fmt: skip
        for i, (loss, sent) in enumerate(zip(rec["train_loss"], rec["step_bytes"], strict=True)):
            steps.append({"method": method, "step": i + 1, "train_loss": f"{loss:.5f}", "bytes_sent": sent})
    reporting.write_csv(os.path.join(out, "curves.csv"), curves)
    reporting.write_csv(os.path.join(out, "steps.csv"), steps)
    if records:
        text = report_md(results)
        with open(os.path.join(out, "report.md"), "w") as fh:
            fh.write(text)
        plot(records, out)


def plot(records: dict[str, dict[str, Any]], out: str) -> None:
    """``scale.png``: validation loss against the step, and the bytes each method sent per step (log scale)."""
    plt = reporting.pyplot()
    if plt is None:
        return
    fig, (by_step, sent) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    order = list(METHODS)
    for method, rec in records.items():
        style = reporting.method_style(method, order)
        steps, _, vals, total, _ = zip(*rec["curve"], strict=True)
        share = total[-1] / max(1, rec["dense_equivalent_per_step"] * rec["steps"])
        label = f"{LABELS[method]} (sent {share:.3f}x DDP's bytes)"
        by_step.plot(steps, vals, label=label, **style)
        sent.plot(range(1, len(rec["step_bytes"]) + 1), [max(1, b) for b in rec["step_bytes"]], label=LABELS[method],
                  **style)  # fmt: skip
    by_step.set(xlabel="step", ylabel="validation loss (nats/token)", title="validation loss")
    sent.set(xlabel="step", ylabel="bytes sent per step (rank 0)", yscale="log", title="bytes sent per step")
    for ax in (by_step, sent):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(os.path.join(out, "scale.png"), dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ the command


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a small model and 12 steps on the CPU (the test of this "
                    "script)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds the whole command may take (default 480)")
    ap.add_argument("--out", default="out/scale", help="where the report, CSVs, plot and JSON go")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 1000; --tiny: 12)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank and step (default: sized)")
    ap.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated, from {list(METHODS)} (default: {','.join(DEFAULT_METHODS)}); without {BASELINE} "
        "no ratios are reported",
    )
    ap.add_argument("--corpus", default=None, help="python (default), stdlib, or a folder of text")
    ap.add_argument("--max-bytes", type=int, default=None, help="text to read (default 64 MB; --tiny: 300 kB)")
    ap.add_argument("--max-epochs", type=float, default=None, help="the most passes over the training text (2)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 6e-4)")
    ap.add_argument("--seed", type=int, default=0, help="weights and batch order")
    ap.add_argument("--cache-dir", default=None, help="the token cache (default: TextFolder's)")
    return ap


def resolve_size(args: argparse.Namespace) -> Size:
    """The ``Size`` of the command line: ``FULL`` or ``TINY`` with the given fields replaced."""
    size = TINY if args.tiny else FULL
    given = {
        "steps": args.steps,
        "batch": args.batch,
        "corpus": args.corpus,
        "max_bytes": args.max_bytes,
        "max_epochs": args.max_epochs,
        "peak_lr": args.lr,
    }
    return dataclasses.replace(size, seed=args.seed, **{k: v for k, v in given.items() if v is not None})


def device_info(device: torch.device) -> dict[str, Any]:
    """The device and software versions, as the report states them."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = device.type == "cuda"
    return {
        "name": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "cuda": cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter() - (reporting.process_age_s() if argv is None else 0.0)  # None: a command
    args = build_parser().parse_args(argv)
    exit_status = cpu_fallback(args.tiny, interpret_kernels=False)
    if exit_status is not None:
        return exit_status
    cuda = torch.cuda.is_available()
    size = resolve_size(args)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods must name some of {list(METHODS)}; got {methods}")
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.set_float32_matmul_precision("high")
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    elapsed: Callable[[], float] = lambda: time.perf_counter() - t_start  # noqa: E731

    train, val, data = load_corpus(size, cache_dir)
    print(f"text: {data['files']} files, {data['train_tokens']:,} train tokens ({data['seconds']:.1f} s)", flush=True)
    base = base_model(size)
    shared = Shared(size, device, base, train, validation_batches(val, size, device))
    results: dict[str, Any] = {
        "command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device_info(device),
        "size": dataclasses.asdict(size),
        "parameters": sum(p.numel() for p in base.parameters()),
        "data": data,
        "budget_s": args.budget_s,
        "runs": {},
        "skipped": [],
    }
    results["warm_s"] = {m: warm_kernels(m, size.steps, shared) for m in methods if m != BASELINE}
    probe = probe_step(shared, methods, size.steps)
    results["probe"] = dataclasses.asdict(probe)
    results["before_runs_s"] = elapsed()
    try:
        plan = make_plan(probe, size, methods, args.budget_s - elapsed() - REPORT_S, len(train), size.steps)
    except SystemExit as refusal:  # too little time: keep what was measured, and say why nothing trained
        results["error"] = str(refusal)
        write_outputs(results, args.out)
        print(f"not run: {refusal}", flush=True)
        return 2
    results["plan"] = dataclasses.asdict(plan)
    results["lr_warmup_steps"] = lr_warmup_steps(plan.steps, size)
    results["eval_every"] = eval_every(plan.steps, size)
    print(f"plan: {plan.steps} steps, batch {plan.batch} per rank (limited by {plan.limit}), predicted "
          f"{sum(plan.predicted_s.values()):.0f} s for the runs; {elapsed():.0f} s so far", flush=True)  # fmt: skip
    for m in methods:
        # Skip a run that would end past the budget: the measured runs before it say how far off the plan is.
        done = results["runs"].values()
        ratio = max([r["wall_s"] / plan.predicted_s[r["method"]] for r in done], default=1.0)
        if elapsed() + ratio * plan.predicted_s[m] > args.budget_s - REPORT_S:
            results["skipped"].append(m)
            print(f"{m}: skipped, predicted to end past the budget of {args.budget_s:.0f} s", flush=True)
            continue
        rec = run(RunSpec(m, method_config(m, plan.steps), plan.steps, plan.batch), shared)
        results["runs"][m] = rec
        results["total_s"] = elapsed()
        write_outputs(results, args.out)
        print(f"{m}: final validation loss {rec['curve'][-1][2]:.4f} ({rec['wall_s']:.0f} s; {elapsed():.0f} s so "
              "far)", flush=True)  # fmt: skip
    results["total_s"] = elapsed()
    write_outputs(results, args.out)
    report = os.path.join(args.out, "report.md")
    if os.path.exists(report):
        with open(report) as fh:
            print(fh.read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
