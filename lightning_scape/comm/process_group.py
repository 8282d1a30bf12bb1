"""``torch.distributed`` collectives on a process group (gloo on the CPU, NCCL on CUDA)."""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scape.comm.base import Pending
from lightning_scape.comm.exit_report import report_on_local_rank_zero

log = logging.getLogger(__name__)

# On gloo an all-to-all or all-gather sends each peer its part as one message, and back to back such collectives
# lose the overlap of the two directions of a link: on a slow link SCAPE's dense step (all-to-all, then
# all-gather) took half as long again as DDP's all-reduce of the same bytes. Sent as slices of at most this many
# bytes per peer, all launched before any is waited on, it runs at about DDP's speed; smaller slices are faster on
# slow links and slower on fast ones (each slice is one more gloo collective to run). docs/benchmarks.md, "The
# dense step", has the measurements.
GLOO_SLICE_BYTES = 256 * 1024


class _TorchWork:
    def __init__(self, works: list[dist.Work | None], name: str, group_desc: str, timeout_s: float) -> None:
        self._works = works
        self._name = name
        self._group_desc = group_desc
        self._timeout_s = timeout_s
        if works:
            IN_FLIGHT.add(self)

    def wait(self) -> None:
        if not self._works:
            return
        start = time.monotonic()
        deadline = start + self._timeout_s
        try:
            for work in self._works:  # in launch order, each within what is left of the one timeout
                if work is not None:
                    work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as exc:
            IN_FLIGHT.failed = IN_FLIGHT.collective_failed = True
            ended = _how_it_ended(time.monotonic() - start, self._timeout_s)
            error = RuntimeError(
                f"SCAPE collective {self._name} on {self._group_desc} {ended}: another rank probably died or "
                f"stopped calling the same collectives. Underlying error: {exc}"
            )
            report_on_local_rank_zero(error)
            raise error from None  # the underlying error is in the message: one traceback, not three
        finally:
            IN_FLIGHT.discard(self)
        self._works = []


def _how_it_ended(waited_s: float, timeout_s: float) -> str:
    """How the wait ended, in words: it timed out (used up the timeout), or it failed after the time waited (a peer's
    death is usually reported within seconds; the timeout is the bound, not what happened)."""
    if waited_s >= 0.99 * timeout_s:
        return f"timed out after {waited_s:.0f} s (the collective timeout)"
    return f"failed after {waited_s:.1f} s of waiting (the timeout is {timeout_s:.0f} s)"


class _InFlight:
    """This process's collectives launched and not yet waited on, and what the process does at exit.

    Tensors created in Python and handed to a gloo collective are freed by gloo's worker thread when it is the last
    to hold them, and that takes the GIL. If this happens while the interpreter finalizes, the process aborts
    ("terminate called without an active exception", SIGABRT) after a run that succeeded: for a collective still
    in flight at exit (a Fabric script ends with its last step's mask all-gather in flight, as Fabric has no end
    of run to wait at), and even for one waited on just before (the worker thread lets go of it after the wait
    returns, or, where a later barrier still refers to it, after that barrier). So at exit, while the interpreter is
    whole, the process waits for its collectives in launch order and releases its process groups
    (:func:`release_process_groups`). A failing process (an uncaught exception, one of these collectives failed, or
    :func:`abandon_in_flight` was called) waits for nothing, since its peers may never answer; it releases its
    process groups only where none of its collectives is in flight or failed.
    """

    def __init__(self) -> None:
        self.works: dict[int, _TorchWork] = {}  # in launch order
        self.failed = False  # the run failed (abandon_in_flight, or a collective failed)
        self.collective_failed = False  # one of these collectives failed: a peer may be gone
        self._at_exit_registered = False

    def add(self, work: _TorchWork) -> None:
        if not self._at_exit_registered:
            atexit.register(self.finish_at_exit)
            self._at_exit_registered = True
        self.works[id(work)] = work

    def discard(self, work: _TorchWork) -> None:
        self.works.pop(id(work), None)

    def finish_at_exit(self) -> None:
        """Wait for every collective still in flight, in launch order, then destroy the process groups. After a
        failure, destroy them only where nothing is in flight and no collective failed: there is nothing to
        wait for, and gloo's threads are done before the interpreter finalizes (a refused checkpoint, a
        failing training step)."""
        if not dist.is_initialized():  # the program destroyed its groups; an object may still hold one
            release_process_groups()
            return
        exiting_on_error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if self.failed or exiting_on_error:
            if not self.works and not self.collective_failed:
                release_process_groups()
            return
        for work in list(self.works.values()):
            try:
                work.wait()
            except RuntimeError as exc:  # the run itself is over: say so, and leave without waiting further
                log.warning("lightning_scape: a collective still in flight when the process exited failed. %s", exc)
                return
        release_process_groups()


def release_process_groups() -> None:
    """Destroy the process groups, and leave no gloo worker thread with work to finish when the interpreter finalizes.

    ``destroy_process_group`` ends gloo's worker threads only where it drops the last reference to a group (on gloo
    ``ProcessGroup.shutdown`` does nothing): a group that an object still holds, or a reference cycle (a hook bound
    to an object that holds a ``DistributedDataParallel`` wrapper), keeps them running into finalization, where one
    that only then lets go of a finished collective's tensor aborts the process. So: destroy; where gloo threads are
    left, let them finish (:func:`_wait_for_idle_gloo_threads`), then collect reference cycles, which ends the
    threads of a group only a cycle held. In that order: a group whose last reference the garbage collector drops
    joins its threads with the GIL held, which must not wait on a thread that waits for the GIL. The collection
    (a fraction of a second with torch loaded) runs only where threads were left. Where the program destroyed its
    groups already, only the last two.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _wait_for_idle_gloo_threads()
    if _gloo_threads_busy() is not None:  # a group is still held
        gc.collect()


# Gloo's worker threads, by the name torch gives them; where /proc or the name is missing, nothing is waited for.
_GLOO_WORKER_THREAD = "pt_gloo_runloop"


def _gloo_threads_busy() -> bool | None:
    """Whether one of this process's gloo worker threads is running or runnable; None where it has none (or the
    system has no ``/proc``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    seen = False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if fh.read().strip() != _GLOO_WORKER_THREAD:
                    continue
            with open(f"/proc/self/task/{tid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        seen = True
        if state != "S":
            return True
    return False if seen else None


def _wait_for_idle_gloo_threads(timeout_s: float = 1.0) -> None:
    """Sleep, the GIL free, until every gloo worker thread has been seen asleep 5 times in a row (at most
    ``timeout_s``): a thread that waits for the GIL to let go of a finished collective gets it now, while the
    interpreter is whole (a thread waiting for the GIL sleeps too, but one that wanted it has had it by then).
    Linux only; elsewhere nothing is waited for."""
    if _gloo_threads_busy() is None:
        return
    quiet, deadline = 0, time.monotonic() + timeout_s
    while quiet < 5 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = 0 if _gloo_threads_busy() else quiet + 1


IN_FLIGHT = _InFlight()


def abandon_in_flight() -> None:
    """Let this process exit without waiting for its collectives in flight: the run failed (a strategy's teardown
    after an exception, which drops them too), and its peers may never answer them."""
    IN_FLIGHT.failed = True


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

    def _wrap(self, work: dist.Work | list[dist.Work | None] | None, name: str) -> Pending:
        return _TorchWork(work if isinstance(work, list) else [work], name, self._desc, self.timeout_s)

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Async all-reduce (sum), in place."""
        w = dist.all_reduce(_wire(tensor), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._wrap(w, f"all_reduce({tensor.numel()} x {tensor.dtype})")

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Async reduce-scatter (sum).

        On gloo it is an all-to-all plus a local sum in rank order: gloo's own reduce-scatter puts as many
        bytes on the wire as an all-reduce, twice what the ring formula charges (``docs/algorithm.md``
        section 5).
        """
        name = f"reduce_scatter({input.numel()} x {input.dtype})"
        if self._gloo:
            received = torch.empty_like(input)
            works = self._gloo_all_to_all(received, input)
            return _SumOnWait(self._wrap(works, name), received, output, self.world_size)
        w = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return self._wrap(w, name)

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-to-all of equal slices."""
        name = f"all_to_all({input.numel()} x {input.dtype})"
        if self._gloo:
            return self._wrap(self._gloo_all_to_all(output, input), name)
        w = dist.all_to_all_single(_wire(output), _wire(input), group=self.group, async_op=True)
        return self._wrap(w, name)

    def _gloo_all_to_all(self, output: Tensor, input: Tensor) -> list[dist.Work | None]:
        """gloo's all-to-all in slices of at most :data:`GLOO_SLICE_BYTES` per peer, all launched at once."""
        sent, got = _wire(input).view(self.world_size, -1), _wire(output).view(self.world_size, -1)
        return [
            dist.all_to_all(list(got[:, cols].unbind()), list(sent[:, cols].unbind()), group=self.group, async_op=True)
            for cols in _gloo_slices(sent)
        ]

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-gather; int16 travels as bytes (gloo has no int16)."""
        name = f"all_gather({input.numel()} x {input.dtype})"
        if self._gloo:
            mine, parts = _wire(input), _wire(output).view(self.world_size, -1)
            works = [
                dist.all_gather(list(parts[:, cols].unbind()), mine[cols], group=self.group, async_op=True)
                for cols in _gloo_slices(parts)
            ]
            return self._wrap(works, name)
        w = _all_gather(_wire(output), _wire(input), group=self.group, async_op=True)
        return self._wrap(w, name)


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


def _gloo_slices(per_peer: Tensor) -> list[slice]:
    """Column ranges of ``per_peer`` (one row per peer) of at most :data:`GLOO_SLICE_BYTES` each."""
    n = per_peer.shape[1]
    step = max(1, GLOO_SLICE_BYTES // per_peer.element_size())
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def _wire(t: Tensor) -> Tensor:
    """A dtype every backend moves: int16 is viewed as uint8 (gather and copy only)."""
    return t.view(torch.uint8) if t.dtype == torch.int16 else t
