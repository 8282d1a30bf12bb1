"""W simulated ranks in one process: in-memory collectives between threads (see :func:`lightning_scape.simulate`).

Each collective sums the ranks' inputs in rank order. For W = 2 that is bitwise what gloo and NCCL compute
(fp addition is commutative); for W > 2 the association order of a real backend may differ in the last bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_scape.comm.base import Pending


@dataclass
class _Slot:
    name: str
    inputs: list[Tensor | None]
    consumed: int = 0


@dataclass
class Rendezvous:
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

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
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

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Every rank's slice ``rank``, in rank order."""
        seq = self._rv.contribute(self.rank, f"all_to_all[{input.numel()}]", input)
        n = output.numel() // self.world_size

        def finish() -> None:
            parts = self._rv.collect(self.rank, seq)
            output.copy_(torch.cat([p[self.rank * n : (self.rank + 1) * n] for p in parts]))

        return _SimPending(finish)
