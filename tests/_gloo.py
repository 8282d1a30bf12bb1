"""Run a worker in W real processes joined by a gloo process group (CPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_scape.workloads import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; their results by rank."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, out)) for r in range(world_size)]
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
