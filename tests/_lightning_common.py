"""Shared by the Lightning worker scripts and the tests: a tiny model, its data, and bare-engine references.

The references run the same training with :class:`ScapeEngine` directly (``simulate`` for W threads), so a
strategy run is checked against code that does not use the adapters. For W = 2 a simulated sum is
bitwise what gloo computes, so the final parameters must match exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator

IN, HID, OUT = 24, 40, 8
N_SAMPLES = 32
BATCH = 4
LR = 0.02
# Small enough for a few-thousand-parameter model: chunks of 64, 6 slots each, 3 buckets, 2 dense steps.
SCAPE = {"density": 0.1, "chunk_size": 64, "dense_warmup_steps": 2, "bucket_cap_mb": 0.004}
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_lightning_worker.py")
PYTHON = sys.executable


def make_net(seed: int = 0) -> nn.Sequential:
    """Three linear layers (about 2.6k parameters), identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net


def dataset() -> TensorDataset:
    """32 fixed samples."""
    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(N_SAMPLES, IN, generator=g), torch.randn(N_SAMPLES, OUT, generator=g))


def param_groups(net: nn.Module) -> list[dict[str, Any]]:
    """Weights with decay, biases without and at half the learning rate."""
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": LR / 2},
    ]


def lr_lambda(step: int) -> float:
    """A per-step schedule, so that a wrong step count or a lost LR shows in the parameters."""
    return 1.0 / (1.0 + 0.1 * step)


def flat(params: Any) -> Tensor:
    """Parameters as one fp64 vector."""
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def rank_batches(rank: int, world_size: int, epochs: int, shuffle: bool = False) -> list[tuple[Tensor, Tensor]]:
    """This rank's batches: indices rank, rank + W, ... or, with ``shuffle``, what the Trainer's
    ``DistributedSampler(shuffle=True, seed=0)`` yields after ``set_epoch(epoch)``."""
    data = dataset()
    x, y = data.tensors
    out = []
    for epoch in range(epochs):
        if shuffle:
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            idx = list(sampler)
        else:
            idx = list(range(rank, N_SAMPLES, world_size))
        for i in range(0, len(idx), BATCH):
            sel = torch.tensor(idx[i : i + BATCH])
            out.append((x[sel], y[sel]))
    return out


def reference(
    world_size: int = 2,
    epochs: int = 2,
    accumulate: int = 1,
    max_norm: float | None = None,
    clip_value: float | None = None,
    autocast: torch.dtype | None = None,
    fp16_scale: float | None = None,
    inject_inf_at: int | None = None,
    scape: dict[str, Any] | None = None,
    shuffle: bool = True,
) -> list[dict[str, Any]]:
    """The bare-engine run that a strategy run must reproduce; per rank: final parameters and norms.

    Args:
        world_size: Simulated ranks.
        epochs: Passes over the data.
        accumulate: Micro-batches per optimizer step (all but the last under ``no_sync``).
        max_norm: Global-norm clipping.
        clip_value: Value clipping.
        autocast: Run forward under ``torch.autocast("cpu", dtype)``.
        fp16_scale: Initial loss scale of a GradScaler-like procedure (halved on a skipped step).
        inject_inf_at: Optimizer step (0-based) at which rank 1's loss is multiplied by inf.
        scape: SCAPE options (default :data:`SCAPE`).
        shuffle: The Trainer's data order (see :func:`rank_batches`); False for the Fabric loops.
    """
    cfg = ScapeConfig(**(scape or SCAPE))

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        net = make_net()
        opt = AdamS(param_groups(net), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        scale = fp16_scale
        engine = ScapeEngine(
            opt, cfg, comm, param_order=list(net.parameters()),
            loss_scale=None if fp16_scale is None else (lambda: scale), skip_nonfinite=fp16_scale is not None,
        )  # fmt: skip
        norms, skipped, trace = [], [], []
        batches = rank_batches(rank, world_size, epochs, shuffle)
        step = 0
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % accumulate == 0 or i + 1 == len(batches)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None, cache_enabled=False):
                loss = torch.nn.functional.mse_loss(net(x), y)
            if inject_inf_at == step and rank == 1 and last:
                loss = loss * float("inf")
            loss = loss / accumulate
            if scale is not None:
                loss = loss * scale
            if last:
                loss.backward()
                engine.step(max_grad_norm=max_norm, clip_value=clip_value)
                norms.append(engine.last_grad_norm)
                skipped.append(engine.last_step_skipped)
                if scale is not None and engine.last_step_skipped:
                    scale /= 2
                with warnings.catch_warnings():  # AdamS.step itself never runs: the engine steps
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
                    sched.step()
                engine.zero_grad()
                trace.append(flat(net.parameters()))
                step += 1
            else:
                with engine.no_sync():
                    loss.backward()
        state = engine.state_dict()
        engine.close()
        return {"params": flat(net.parameters()), "norms": norms, "skipped": skipped, "engine": state, "trace": trace}

    return simulate(world_size, worker)


# ------------------------------------------------------------------------------------ launching


def child_env(**extra: str) -> dict[str, str]:
    """The environment for worker processes: one thread, no stray distributed variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "NODE_RANK", "RANK",
                                                                        "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC",
                                                                        "PL_", "SLURM"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=HERE + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def run_script(
    args: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>``; fail with its output when it does not exit 0."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [PYTHON, *args], env=env or child_env(), capture_output=True, text=True, timeout=timeout_s, cwd=HERE
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode} after {time.perf_counter() - t0:.1f}s\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def load_outputs(outdir: str, name: str, world_size: int = 2) -> list[Any]:
    """What each rank of a worker scenario saved."""
    return [torch.load(os.path.join(outdir, f"{name}_rank{r}.pt"), weights_only=False) for r in range(world_size)]


def for_ranks(fn: Callable[[int], Any], world_size: int = 2) -> list[Any]:
    """``[fn(0), fn(1), ...]``."""
    return [fn(r) for r in range(world_size)]
