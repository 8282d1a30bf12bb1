"""W data-parallel ranks simulated in one process: the same engine, W threads, in-memory collectives.

Quality experiments (and tests) can run the exact SCAPE algorithm for W ranks without a process group:

    def worker(rank: int, comm: Communicator) -> Tensor:
        model = make_model(); engine = ScapeEngine(AdamS(model.parameters()), cfg, comm)
        ...   # each rank feeds its own data shard
        return torch.nn.utils.parameters_to_vector(model.parameters())

    params_per_rank = simulate(world_size=4, worker=worker)

Each collective sums the ranks' inputs in rank order. For W = 2 that is bitwise what gloo and NCCL
compute (fp addition is commutative); for W > 2 the association order of the real backend may differ
in the last bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_scape.comm import Communicator, Pending

T = TypeVar("T")


@dataclass
class _Slot:
    name: str
    inputs: list[Tensor | None]
    consumed: int = 0


@dataclass
class _Rendezvous:
    world_size: int
    timeout_s: float
    cond: threading.Condition = field(default_factory=threading.Condition)
    slots: dict[int, _Slot] = field(default_factory=dict)
    issued: list[int] = field(default_factory=list)
    failure: BaseException | None = None

    def __post_init__(self) -> None:
        self.issued = [0] * self.world_size

    def contribute(self, rank: int, name: str, tensor: Tensor) -> int:
        with self.cond:
            seq = self.issued[rank]
            self.issued[rank] += 1
            slot = self.slots.setdefault(seq, _Slot(name, [None] * self.world_size))
            if slot.name != name:
                self.failure = RuntimeError(
                    f"simulated collective #{seq}: rank {rank} issued {name} but another rank issued "
                    f"{slot.name}; ranks must issue the same collectives in the same order."
                )
                self.cond.notify_all()
                raise self.failure
            # A snapshot: the caller may reuse its buffer as soon as its own wait returns, while
            # slower ranks still read this input.
            slot.inputs[rank] = tensor.detach().clone()
            self.cond.notify_all()
            return seq

    def collect(self, rank: int, seq: int) -> list[Tensor]:
        with self.cond:
            slot = self.slots[seq]
            ok = self.cond.wait_for(
                lambda: self.failure is not None or all(x is not None for x in slot.inputs), self.timeout_s
            )
            if self.failure is not None:
                raise RuntimeError(f"simulated rank {rank}: another rank failed") from self.failure
            if not ok:
                missing = [r for r, x in enumerate(slot.inputs) if x is None]
                self.failure = TimeoutError(
                    f"simulated collective #{seq} ({slot.name}) timed out after {self.timeout_s}s waiting "
                    f"for ranks {missing}"
                )
                self.cond.notify_all()
                raise self.failure
            inputs = [x for x in slot.inputs if x is not None]
            slot.consumed += 1
            if slot.consumed == self.world_size:
                del self.slots[seq]
            return inputs

    def abort(self, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.cond.notify_all()


class _SimPending:
    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class ThreadGroupCommunicator:
    """One simulated rank's view of an in-process group (see :func:`simulate`)."""

    def __init__(self, rendezvous: _Rendezvous, rank: int) -> None:
        self._rv = rendezvous
        self.rank = rank
        self.world_size = rendezvous.world_size

    def _sum(self, parts: list[Tensor]) -> Tensor:
        acc = parts[0].clone()
        for p in parts[1:]:
            acc.add_(p)
        return acc

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Sum in rank order, in place."""
        seq = self._rv.contribute(self.rank, f"all_reduce[{tensor.numel()}]", tensor)

        def finish() -> None:
            tensor.copy_(self._sum(self._rv.collect(self.rank, seq)))

        return _SimPending(finish)

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """This rank's slice of the rank-ordered sum."""
        seq = self._rv.contribute(self.rank, f"reduce_scatter[{input.numel()}]", input)
        n = output.numel()

        def finish() -> None:
            parts = self._rv.collect(self.rank, seq)
            output.copy_(self._sum([p[self.rank * n : (self.rank + 1) * n] for p in parts]))

        return _SimPending(finish)

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Concatenation in rank order."""
        seq = self._rv.contribute(self.rank, f"all_gather[{input.numel()}]", input)

        def finish() -> None:
            output.copy_(torch.cat(self._rv.collect(self.rank, seq)))

        return _SimPending(finish)


def simulate(world_size: int, worker: Callable[[int, Communicator], T], timeout_s: float = 300.0) -> list[T]:
    """Run ``worker(rank, communicator)`` for W simulated ranks in W threads; return their results.

    Args:
        world_size: W >= 1.
        worker: The per-rank program; it must issue the same collectives in the same order on every rank
            (as a real data-parallel program does).
        timeout_s: A rank waiting longer than this on a collective raises, naming the missing ranks.

    Returns:
        The workers' return values, by rank.

    Raises:
        The first exception any rank raised (the other ranks are aborted, never left hanging).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    rv = _Rendezvous(world_size, timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = worker(rank, ThreadGroupCommunicator(rv, rank))
        except BaseException as exc:  # propagate to the caller, and unblock the other ranks
            errors[rank] = exc
            rv.abort(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"scape-sim-rank{r}") for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first = next((e for e in errors if e is not None and not _is_echo(e)), None) or next(
        (e for e in errors if e is not None), None
    )
    if first is not None:
        raise first
    return results


def _is_echo(exc: BaseException) -> bool:
    """An abort seen by a rank because another rank failed first."""
    return isinstance(exc, RuntimeError) and "another rank failed" in str(exc)
