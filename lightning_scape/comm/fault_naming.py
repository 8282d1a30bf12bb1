"""Collectives whose failures name the rank that stopped answering (what the Lightning strategies use).

Each process publishes a heartbeat (liveness and how many SCAPE collectives it has issued) in the
rendezvous store. When a collective fails or times out, the waiting rank watches the others' heartbeats
for a few intervals and says which rank died or froze, or which one never issued the collective.

Timing, for a collective timeout T (the strategies' ``timeout``): heartbeats every
:func:`heartbeat_interval` (T / 30, within [0.1, 2] s); a diagnosis watches for :func:`diagnosis_seconds`
(three intervals, at most 6 s); a wait gives up after :func:`collective_wait_seconds` (T less the
diagnosis, at least T / 2), so the error, diagnosis included, comes within T.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_scape.comm.base import Communicator, Pending, SoloCommunicator
from lightning_scape.comm.exit_report import report_on_local_rank_zero
from lightning_scape.comm.process_group import ProcessGroupCommunicator

log = logging.getLogger(__name__)


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats of a rank: a thirtieth of the collective timeout, within [0.1, 2]."""
    return min(2.0, max(0.1, timeout_s / 30))


def diagnosis_seconds(timeout_s: float) -> float:
    """How long a rank watches the others' heartbeats after a failed collective: three intervals."""
    return 3 * heartbeat_interval(timeout_s)


def collective_wait_seconds(timeout_s: float) -> float:
    """How long one wait may block: the timeout less the diagnosis time, and at least half the timeout.

    The process-group timeout of the Lightning strategies is the same number: a gloo or NCCL operation
    that outlives the engine's wait would keep a failed process from exiting.
    """
    return max(timeout_s - diagnosis_seconds(timeout_s), 0.5 * timeout_s)


class _Heartbeat:
    """This process's liveness and collective progress, published in the c10d store by a daemon thread.

    When a collective fails, :meth:`diagnose` reads every rank's entry twice: a rank whose heartbeat does
    not move died or froze; a rank that is alive but has not issued the collective is stuck elsewhere.
    """

    _lock = threading.Lock()
    _current: _Heartbeat | None = None

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.interval_s = heartbeat_interval(timeout_s)
        self.diagnosis_s = diagnosis_seconds(timeout_s)
        self.issued = 0  # SCAPE collectives this process has launched
        self._beats = 0
        self._store_timeout = timedelta(seconds=max(2.0, 4 * self.interval_s))  # one store call at most
        self._store = store.clone()
        self._store.set_timeout(self._store_timeout)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scape-heartbeat", daemon=True)
        self._thread.start()
        # A daemon thread still inside a store call when the interpreter finalizes is unwound through C++
        # frames that may not throw, and the process aborts ("terminate called without an active
        # exception", SIGABRT) after a run that succeeded. atexit runs before finalization, so the thread
        # is out of the store by then (tests/test_heartbeat.py reproduces the abort without this stop).
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the heartbeat thread and wait for it to leave the store (at most one store timeout)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store_timeout.total_seconds() + 1.0)

    @classmethod
    def for_process(cls, timeout_s: float) -> _Heartbeat | None:
        """The process-wide heartbeat (started on first use); None when the store is unavailable."""
        rank, world = dist.get_rank(), dist.get_world_size()
        with cls._lock:
            hb = cls._current
            if hb is None or (hb.rank, hb.world_size) != (rank, world):
                try:
                    store = dist.distributed_c10d._get_default_store()
                    if hb is not None:
                        hb.stop()
                    hb = cls(store, rank, world, timeout_s)
                except Exception as exc:  # no store, no diagnosis: the collective errors still name themselves
                    log.debug("lightning_scape: no heartbeat (%s)", exc)
                    return None
                cls._current = hb
            return hb

    @classmethod
    def stop_current(cls) -> None:
        """Stop the process-wide heartbeat, if one runs; the next :meth:`for_process` starts a new one."""
        with cls._lock:
            hb, cls._current = cls._current, None
        if hb is not None:
            hb.stop()

    @staticmethod
    def _key(rank: int) -> str:
        return f"lightning_scape/heartbeat/{rank}"

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._beats += 1
            try:
                self._store.set(self._key(self.rank), f"{self._beats} {self.issued}")
            except Exception:  # the store went away (rank 0 died); the failing collective will say so
                return
            self._stopped.wait(self.interval_s)

    def _read(self, store: Any) -> dict[int, tuple[int, int] | None]:
        out: dict[int, tuple[int, int] | None] = {}
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = self._key(r)
            if not store.check([key]):
                out[r] = None
                continue
            beats, issued = store.get(key).decode().split()
            out[r] = (int(beats), int(issued))
        return out

    def diagnose(self, seq: int) -> str:
        """Which ranks stopped answering before collective number ``seq`` of this rank, in words."""
        wait = self.diagnosis_s
        try:
            store = self._store.clone()
            store.set_timeout(self._store_timeout)
            first = self._read(store)
            time.sleep(wait)
            second = self._read(store)
        except Exception as exc:
            return (
                f"the rendezvous store is unreachable ({type(exc).__name__}), so the process hosting it (rank 0, "
                "or the launcher) has probably died."
            )
        stopped = [r for r in second if second[r] is None or first[r] == second[r]]
        behind = [r for r in second if r not in stopped and (s := second[r]) is not None and s[1] < seq]
        parts = []
        if stopped:
            parts.append(
                f"rank {', '.join(map(str, stopped))} stopped answering: no heartbeat for {wait:.1f}s (the process "
                "died, was killed, or is frozen)"
            )
        if behind:
            where = ", ".join(f"rank {r} at #{s[1]}" for r in behind if (s := second[r]) is not None)
            parts.append(
                f"{where} never issued this collective (#{seq} here): alive but stuck elsewhere or running "
                "different code"
            )
        if not parts:
            return "every rank is alive and issued this collective: the transport itself failed (network?)."
        return "; ".join(parts) + "."


class _NamedPending:
    def __init__(self, inner: Pending, seq: int, heartbeat: _Heartbeat | None) -> None:
        self._inner = inner
        self._seq = seq
        self._heartbeat = heartbeat

    def wait(self) -> None:
        try:
            self._inner.wait()
        except RuntimeError as exc:
            if self._heartbeat is None:
                raise
            error = RuntimeError(f"{exc}\nSCAPE diagnosis: {self._heartbeat.diagnose(self._seq)}")
            report_on_local_rank_zero(error)
            raise error from None  # the collective's own error is the message's first line


class FaultNamingCommunicator:
    """A process group's collectives, with failures that name the rank that stopped answering.

    A wait gives up after :func:`collective_wait_seconds` (without a heartbeat, after ``timeout_s``), so
    the error, diagnosis included, comes within ``timeout_s``. Heartbeats are global: a diagnosis names global
    ranks, and every process must issue as many of these collectives as the others (true of one engine per
    process, whichever group it runs on).

    Args:
        timeout_s: The collective timeout (the strategies' ``timeout``), in seconds.
        group: The process group (None: the default group).
    """

    def __init__(self, timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
        self.heartbeat = _Heartbeat.for_process(timeout_s)
        wait_s = timeout_s if self.heartbeat is None else collective_wait_seconds(timeout_s)
        self.inner = ProcessGroupCommunicator(group, timeout_s=wait_s)
        self.rank = self.inner.rank
        self.world_size = self.inner.world_size

    def _track(self, launch: Callable[[], Pending]) -> Pending:
        hb = self.heartbeat
        seq = 0
        if hb is not None:
            hb.issued += 1
            seq = hb.issued
        return _NamedPending(launch(), seq, hb)

    def all_reduce_sum(self, tensor: Tensor) -> Pending:
        """Async all-reduce (sum), in place."""
        return self._track(lambda: self.inner.all_reduce_sum(tensor))

    def reduce_scatter_sum(self, output: Tensor, input: Tensor) -> Pending:
        """Async reduce-scatter (sum)."""
        return self._track(lambda: self.inner.reduce_scatter_sum(output, input))

    def all_gather(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-gather."""
        return self._track(lambda: self.inner.all_gather(output, input))

    def all_to_all(self, output: Tensor, input: Tensor) -> Pending:
        """Async all-to-all."""
        return self._track(lambda: self.inner.all_to_all(output, input))


def stop_heartbeat() -> None:
    """Stop this process's heartbeat thread (the end of a run: the strategies' teardown); a later
    :class:`FaultNamingCommunicator` starts a new one. The thread also stops when the process exits."""
    _Heartbeat.stop_current()


def make_communicator(timeout_s: float) -> Communicator:
    """This process's collectives: nothing for one process, else the default group with named failures."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return SoloCommunicator()
    return FaultNamingCommunicator(timeout_s)
