"""Collectives used by the engine, behind one small interface.

Three implementations share it: :class:`ProcessGroupCommunicator` (``torch.distributed``: gloo on the
CPU, NCCL on CUDA), :class:`SoloCommunicator` (world size 1: local copies, nothing sent) and
``lightning_scape.simulation.ThreadGroupCommunicator`` (W simulated ranks in one process).

Every collective is launched asynchronously and returns a :class:`Pending` whose ``wait`` must be
called before the output is read or the input is written again. Byte counting follows the ring
algorithms of SCAPE_SPEC section 4, per rank: all-reduce of n elements sends ``2 (W-1)/W n b`` bytes,
reduce-scatter of a ``W n`` input sends ``(W-1) n b``, all-gather of ``n`` per rank sends ``(W-1) n b``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

# Kinds of traffic that the counters keep apart.
KIND_VALUES = "values"  # compact gradient values (sparse steps)
KIND_PARAMS = "params"  # parameter values at the mask (sharded sparse steps)
KIND_INDICES = "indices"  # int16 mask indices (partitioned mask refresh)
KIND_DENSE = "dense"  # dense warm-up: gradients and parameters
KIND_SCALARS = "scalars"  # gradient-norm all-reduce and other scalars
KIND_SETUP = "setup"  # rank 0's parameters to every rank, once at construction
KINDS: tuple[str, ...] = (KIND_VALUES, KIND_PARAMS, KIND_INDICES, KIND_DENSE, KIND_SCALARS, KIND_SETUP)


class Pending(Protocol):
    """A launched collective."""

    def wait(self) -> None:
        """Block until the collective's output is ready."""


class Done:
    """A collective that completed at launch (world size 1)."""

    def wait(self) -> None:
        """Nothing to wait for."""


class Communicator(Protocol):
    """The collectives of a data-parallel group, as the engine uses them."""

    rank: int
    world_size: int

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Sum ``tensor`` over ranks, in place."""
        ...

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """``output`` = sum over ranks of slice ``rank`` of ``input`` (``len(input) = W len(output)``)."""
        ...

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """``output`` = concatenation over ranks of ``input`` (``len(output) = W len(input)``)."""
        ...


class SoloCommunicator:
    """World size 1: every collective is a local copy and nothing is sent."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Nothing to sum."""
        return Done()

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Copy (the sum over one rank)."""
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Done()

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Copy (the concatenation of one rank)."""
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Done()


class _TorchWork:
    def __init__(self, work: dist.Work | None, name: str, group_desc: str, timeout_s: float) -> None:
        self._work = work
        self._name = name
        self._group_desc = group_desc
        self._timeout_s = timeout_s

    def wait(self) -> None:
        if self._work is None:
            return
        try:
            self._work.wait(timedelta(seconds=self._timeout_s))
        except RuntimeError as exc:
            raise RuntimeError(
                f"SCAPE collective {self._name} on {self._group_desc} failed or timed out after "
                f"{self._timeout_s:.0f}s: another rank probably died or stopped calling the same "
                f"collectives. Underlying error: {exc}"
            ) from exc
        self._work = None


class ProcessGroupCommunicator:
    """``torch.distributed`` collectives on a process group (gloo or NCCL).

    Args:
        group: The process group (None: the default group).
        timeout_s: Seconds a wait may block before raising an error that names the collective.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 1800.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator needs an initialised torch.distributed process group; call "
                "torch.distributed.init_process_group first, or use SoloCommunicator for one process."
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._desc = f"rank {self.rank} of {self.world_size} ({dist.get_backend(group)})"
        self._gloo = dist.get_backend(group) == "gloo"

    def __getstate__(self) -> dict[str, object]:
        raise TypeError("A ProcessGroupCommunicator holds a live process group and cannot be pickled.")

    def _wrap(self, work: dist.Work | None, name: str) -> Pending:
        return _TorchWork(work, name, self._desc, self.timeout_s)

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Async all-reduce (sum), in place."""
        w = dist.all_reduce(_wire(tensor), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._wrap(w, f"all_reduce({tensor.numel()} x {tensor.dtype})")

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Async reduce-scatter (sum).

        On gloo it is an all-to-all plus a local sum in rank order: gloo's own reduce-scatter puts as many
        bytes on the wire as an all-reduce (measured in network namespaces: 4.20 MB for 1M fp32 values at
        W = 2, against 2.10 MB for the all-to-all), twice what the ring formula charges.
        """
        name = f"reduce_scatter({input.numel()} x {input.dtype})"
        if self._gloo:
            received = torch.empty_like(input)
            w = dist.all_to_all_single(received, input, group=self.group, async_op=True)
            return _SumOnWait(self._wrap(w, name), received, output, self.world_size)
        w = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._wrap(w, name)

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-gather; int16 travels as bytes (gloo has no int16)."""
        w = _all_gather(_wire(output), _wire(input), group=self.group, async_op=True)
        return self._wrap(w, f"all_gather({input.numel()} x {input.dtype})")


# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class _SumOnWait:
    """An all-to-all in flight; ``wait`` sums the W received slices, in rank order, into ``output``."""

    def __init__(self, inner: Pending, received: Tensor, output: Tensor, world_size: int) -> None:
        self._inner: Pending | None = inner
        self._parts = received.view(world_size, -1)
        self._output = output

    def wait(self) -> None:
        if self._inner is None:
            return
        self._inner.wait()
        self._inner = None
        self._output.copy_(self._parts[0])
        for part in self._parts[1:]:
            self._output.add_(part)


def _wire(t: Tensor) -> Tensor:
    """A dtype every backend moves: int16 is viewed as uint8 (gather and copy only)."""
    return t.view(torch.uint8) if t.dtype == torch.int16 else t


@dataclass
class ByteCounters:
    """Bytes sent and received by this rank, per kind, for the current step and in total.

    ``dense_equivalent`` is what DDP's dense all-reduce of the same gradients would have sent:
    ``2 (W-1)/W * N * b``. ``wait_s`` is time spent blocked in ``wait`` (communication not hidden
    under compute).
    """

    world_size: int = 1
    step_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    step_received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    total_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    total_received: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    step_dense_equivalent: int = 0
    total_dense_equivalent: int = 0
    step_wait_s: float = 0.0
    total_wait_s: float = 0.0
    steps: int = 0

    def start_step(self) -> None:
        """Clear the per-step numbers."""
        for d in (self.step_sent, self.step_received):
            for k in d:
                d[k] = 0
        self.step_dense_equivalent = 0
        self.step_wait_s = 0.0

    def _add(self, kind: str, nbytes: int) -> None:
        self.step_sent[kind] += nbytes
        self.total_sent[kind] += nbytes
        # Ring collectives receive exactly as much as they send.
        self.step_received[kind] += nbytes
        self.total_received[kind] += nbytes

    def count_all_reduce(self, kind: str, numel: int, itemsize: int) -> None:
        """Ring all-reduce of ``numel`` elements: ``2 (W-1)/W numel b`` (rounded down to a byte)."""
        w = self.world_size
        self._add(kind, (2 * (w - 1) * numel * itemsize) // w)

    def count_reduce_scatter(self, kind: str, input_numel: int, itemsize: int) -> None:
        """Ring reduce-scatter of a ``W n`` input: ``(W-1) n b``."""
        w = self.world_size
        self._add(kind, ((w - 1) * input_numel * itemsize) // w)

    def count_all_gather(self, kind: str, input_numel: int, itemsize: int) -> None:
        """Ring all-gather of ``n`` elements per rank: ``(W-1) n b``."""
        self._add(kind, (self.world_size - 1) * input_numel * itemsize)

    def count_dense_equivalent(self, numel: int, itemsize: int) -> None:
        """What DDP would send for ``numel`` gradient elements this step."""
        w = self.world_size
        n = (2 * (w - 1) * numel * itemsize) // w
        self.step_dense_equivalent += n
        self.total_dense_equivalent += n

    def timed_wait(self, pending: Pending) -> None:
        """``pending.wait()``, adding the blocked time to ``wait_s``."""
        t0 = time.perf_counter()
        pending.wait()
        dt = time.perf_counter() - t0
        self.step_wait_s += dt
        self.total_wait_s += dt

    @property
    def step_sent_bytes(self) -> int:
        """All bytes sent this step."""
        return sum(self.step_sent.values())

    @property
    def total_sent_bytes(self) -> int:
        """All bytes sent so far."""
        return sum(self.total_sent.values())

    def state_dict(self) -> dict[str, object]:
        """The cumulative numbers (for checkpoints)."""
        return {
            "total_sent": dict(self.total_sent),
            "total_received": dict(self.total_received),
            "total_dense_equivalent": self.total_dense_equivalent,
            "total_wait_s": self.total_wait_s,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.total_sent = dict(state["total_sent"])  # type: ignore[call-overload]
        self.total_received = dict(state["total_received"])  # type: ignore[call-overload]
        self.total_dense_equivalent = int(state["total_dense_equivalent"])  # type: ignore[call-overload]
        self.total_wait_s = float(state["total_wait_s"])  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[call-overload]


CommunicatorFactory = Callable[[], Communicator]
