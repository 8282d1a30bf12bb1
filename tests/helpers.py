"""What several test modules share: equality, the tiny net and its data, a text corpus, process launching,
and the engine's reference runs.

Sections: equality; the tiny net; a text corpus; processes (gloo groups); the engine on the tiny net
(``test_engine``, ``test_engine_dist``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import tempfile
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine
from lightning_scape.comm import Communicator
from lightning_scape.workloads import free_port

# ----------------------------------------------------------------------------------------- equality


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors, recursively through lists, tuples and dicts; ``==`` for anything else."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def rel_err(a: Tensor, b: Tensor) -> float:
    """``|a - b| / |b|`` (Euclidean norms)."""
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------- the tiny net

IN, HID, OUT = 24, 40, 8


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Three linear layers 24-40-8 (about 2.6k parameters), identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net.to(dtype)


def random_batch(seed: int, rows: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Inputs ``(rows, IN)`` and targets ``(rows, OUT)`` for the tiny net, normal and fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def param_groups(net: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Weights with decay 0.1; biases without decay and at half the learning rate (as LLM recipes group them)."""
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def flat(params: Iterable[Tensor]) -> Tensor:
    """Parameters as one fp64 vector, in the given order."""
    return torch.cat([p.detach().reshape(-1).double() for p in params])


# ------------------------------------------------------------------------------------ a text corpus

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "lambda", "sigma", "omega", "tensor", "sparse"]


def write_corpus(folder: Path, n_files: int, words: int = 200, seed: int = 0) -> dict[str, bytes]:
    """``n_files`` distinct text files of random words (every tenth in a subfolder); returns relative path ->
    content."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n_files):
        rel = f"sub/doc{i:03d}.txt" if i % 10 == 3 else f"doc{i:03d}.txt"
        text = f"document {i} ({rel}): " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"
        files[rel] = text.encode()
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(files[rel])
    return files


# ---------------------------------------------------------------------------------------- processes


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo process group (CPU);
    their results by rank. ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_gloo_entry, args=(r, world_size, port, fn, args, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"gloo workers did not finish within {timeout_s}s")
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise RuntimeError(f"gloo workers failed with exit codes {codes}")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]


# ----------------------------------------------------------------------- the engine on the tiny net


def make_batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """16 rank- and step-specific samples."""
    return random_batch(1000 * step + rank + 7, 16, dtype)


def run_worker(rank: int, comm: Communicator, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a deterministic engine run on the tiny net (same model everywhere, rank-specific data):
    ``spec["steps"]`` steps of ``ScapeConfig(**spec["config"])``; returns per-step parameters, byte counters and
    masks, and the final layout and residuals."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    cfg = ScapeConfig(**spec["config"])
    model = make_net(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    engine = ScapeEngine(opt, cfg, comm, param_order=list(model.parameters()))
    out: dict[str, Any] = {"params": [], "sent": [], "dense_eq": [], "masks_used": [], "masks_built": []}
    for step in range(spec["steps"]):
        x, y = make_batch(rank, step, dtype)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_used"].append([m.clone() for m in engine.current_masks()])
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        engine.step(max_grad_norm=spec.get("max_grad_norm"))
        engine.zero_grad()
        out["params"].append(flat(model.parameters()))
        out["sent"].append(dict(engine.counters.step_sent))
        out["dense_eq"].append(engine.counters.step_dense_equivalent)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_built"].append([m.clone() for m in engine.last_built_masks()])
    out["padded_numel"] = engine.padded_numel
    out["numel"] = engine.numel
    out["slots"] = engine.slots
    out["residual"] = [bs.residual.clone() for bs in engine.buckets]
    engine.close()
    return out


def reference_dense_adams(spec: dict[str, Any], world_size: int) -> list[Tensor]:
    """What :func:`run_worker` must reproduce at density 1: data-parallel AdamS in one process (average the W
    ranks' gradients, then ``AdamS.step``); the parameters after every step."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = make_net(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    params = []
    for step in range(spec["steps"]):
        grads = []
        for r in range(world_size):
            model.zero_grad(set_to_none=True)
            x, y = make_batch(r, step, dtype)
            (model(x) - y).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        if spec.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        params.append(flat(model.parameters()))
    return params


def mass_worker(rank: int, comm: Communicator, steps: int) -> dict[str, Tensor]:
    """Integer-valued fp64 gradients (so every sum is exact); returns sum g, what was sent, the residual."""
    from lightning_scape.kernels import mask_positions

    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0, exploration=0.25)
    model = make_net(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm)
    (bs,) = engine.buckets  # one bucket: the whole model fits under bucket_cap_mb
    gen = torch.Generator().manual_seed(rank)
    grad_sum = torch.zeros_like(bs.residual)
    sent = torch.zeros_like(bs.residual)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
        mask = engine.current_masks()[0]
        engine.step()  # no backward: the step synchronises the gradients it finds
        grad_sum += bs.grads
        sent.index_add_(0, mask_positions(mask, cfg.chunk_size), bs.values)
        engine.zero_grad()
    engine.close()
    return {"grad_sum": grad_sum, "sent": sent, "residual": bs.residual.clone()}


def _process_group_comm() -> Communicator:
    from lightning_scape import ProcessGroupCommunicator

    return ProcessGroupCommunicator(timeout_s=60)


def gloo_run_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_worker` on the default (gloo) process group (for :func:`run_gloo`)."""
    return run_worker(rank, _process_group_comm(), spec)


def gloo_mass_worker(rank: int, world_size: int, steps: int) -> dict[str, Tensor]:
    """:func:`mass_worker` on the default (gloo) process group (for :func:`run_gloo`)."""
    return mass_worker(rank, _process_group_comm(), steps)
