"""The int8 wire's sparse step launches few operations per bucket: counted, not timed.

On a GPU the int8 step is bound by the host launching small operations (``docs/performance.md``, "The int8
wire's step on a GPU"), so their number is what must not creep back. A ``TorchDispatchMode`` counts, on rank 0 of
two simulated ranks, every operation one sparse step dispatches (and ``zero_grad`` after it, as a training loop
calls it): each kernel entry point as one launch (its CPU reference's operations are not counted), the simulated
collectives not at all (a real backend issues one call each, counted apart). A count is deterministic: the bounds
hold on any machine.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_scape.kernels as K
from lightning_scape import ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator, thread_group
from lightning_scape.examples.workloads import adams_optimizer

KERNELS = ("ef_compact", "round_int8", "select_mask", "sparse_adams", "scatter_decay", "dense_adams")
COLLECTIVES = ("all_reduce_sum", "reduce_scatter_sum", "all_gather", "all_to_all")
ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default"}
ALLOCATIONS |= {"aten.empty_strided.default"}
SYNCS = {"aten._local_scalar_dense.default"}  # .item(): a host-device synchronisation

_state = threading.local()  # per simulated rank: counting on, and how deep inside a kernel or a collective


def _counting() -> bool:
    return getattr(_state, "on", False) and getattr(_state, "inside", 0) == 0


class _Count(TorchDispatchMode):
    """Counts what a rank's thread dispatches: launches, allocations, views and synchronisations."""

    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _counting():
            name = str(func)
            kind = "alloc" if name in ALLOCATIONS else "sync" if name in SYNCS else "view" if func.is_view else "launch"
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


def _one_launch(fn: Callable[..., Any], counts: collections.Counter[str], kind: str) -> Callable[..., Any]:
    """``fn`` counted as one ``kind`` (a kernel is one launch on a GPU, a collective one backend call), its own
    operations not counted."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _counting():
            counts[kind] += 1
        _state.inside = getattr(_state, "inside", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.inside -= 1

    return wrapped


def _count_as_one(monkeypatch: pytest.MonkeyPatch, counts: collections.Counter[str]) -> None:
    """Count each kernel entry point as one launch and each simulated collective as one call (``_one_launch``)."""
    for name in KERNELS:
        monkeypatch.setattr(K, name, _one_launch(getattr(K, name), counts, "launch"))
    comm_class = thread_group.ThreadGroupCommunicator
    for name in COLLECTIVES:
        monkeypatch.setattr(comm_class, name, _one_launch(getattr(comm_class, name), counts, "collective"))
    monkeypatch.setattr(thread_group._SimPending, "wait", _one_launch(thread_group._SimPending.wait, counts, "wait"))


def count_sparse_step(monkeypatch: pytest.MonkeyPatch) -> tuple[collections.Counter[str], int]:
    """What rank 0 dispatches in its third sparse step on the int8 wire (W = 2), and the number of buckets."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 32))
    # Several buckets of 64-coordinate chunks, the matrices' param group and the vectors' (no weight decay).
    cfg = ScapeConfig(
        wire_format="int8", density=0.1, chunk_size=64, dense_warmup_steps=1, density_ramp_steps=0, bucket_cap_mb=0.04
    )
    counts: collections.Counter[str] = collections.Counter()

    def worker(rank: int, comm: Communicator) -> int:
        model = copy.deepcopy(base)  # the same initial values on both ranks
        engine = ScapeEngine(adams_optimizer(model, 1e-3), cfg, comm, list(model.parameters()))
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):  # the dense warm-up step, then sparse steps: the third is counted
            for bs in engine.buckets:
                bs.grads.normal_(generator=gen)
            _state.on = step == 3 and rank == 0
            with _Count(counts) if _state.on else contextlib.nullcontext():
                engine.step(max_grad_norm=1.0)
                engine.zero_grad()
            _state.on = False
        engine.close()
        return len(engine.buckets)

    _count_as_one(monkeypatch, counts)
    return counts, simulate(2, worker)[0]


def test_a_sparse_int8_step_launches_few_operations_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    counts, buckets = count_sparse_step(monkeypatch)
    assert buckets >= 4
    # The counting itself: per bucket the values' all-to-all, the new values' all-gather and the next mask's
    # index all-gather, and the clipping norm's scalar all-reduce.
    assert counts["collective"] == 3 * buckets + 1
    # Counted when this test was written: 93 launches (20 per bucket, 13 for the step) and 4 allocations (the next
    # masks' gather buffers). Before the int8 packets were reused and written in place, decoded without copies and
    # the mask positions computed once per bucket and step: 182 launches (43 per bucket) and 36 allocations. On the
    # 110M-parameter model's layout (19 buckets): 395 launches and 19 allocations, from 827 and 171.
    assert counts["launch"] <= 96, counts
    assert counts["alloc"] <= buckets, counts
    assert counts["sync"] == 1, counts  # the clipping coefficient's norm, read on the host
