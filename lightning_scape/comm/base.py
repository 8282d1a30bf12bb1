"""The interface between the engine and a data-parallel group's collectives.

Every collective is launched asynchronously and returns a :class:`Pending` whose ``wait`` must be called
before the output is read or the input is written again. Implementations:

* :class:`SoloCommunicator` (this module): world size 1, local copies, nothing sent;
* :class:`~lightning_scape.comm.process_group.ProcessGroupCommunicator`: ``torch.distributed`` (gloo on the
  CPU, NCCL on CUDA);
* :class:`~lightning_scape.comm.fault_naming.FaultNamingCommunicator`: the default process group, with
  failures that name the rank that stopped answering (what the Lightning strategies use);
* :class:`~lightning_scape.comm.thread_group.ThreadGroupCommunicator`: W simulated ranks in one process
  (:func:`lightning_scape.simulate`).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


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

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Slice ``r`` of ``output`` = slice ``rank`` of rank ``r``'s ``input`` (both ``W`` equal slices)."""
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

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Copy (one rank's one slice)."""
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Done()
