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
from typing import Any, TypeVar

from lightning_scape.comm.base import Communicator
from lightning_scape.comm.thread_group import Rendezvous, ThreadGroupCommunicator

T = TypeVar("T")


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
        ValueError: ``world_size`` is below 1.
        BaseException: The first exception any rank raised, re-raised (the other ranks are aborted, never left
            hanging).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1.")
    rv = Rendezvous(world_size, timeout_s)
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
