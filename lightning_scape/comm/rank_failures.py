"""A failure on any rank, reported once: the ranks agree on it, rank 0 says it, the others end quietly.

Without this, every process of a run prints its own traceback of the same failure (dozens of lines, once per
rank), and a rank that did not fail itself may end with an unrelated error of a collective whose peer is gone.
Where the strategies can check a step on every rank before going on (set-up, loading a checkpoint), the ranks
exchange their outcome (:func:`agree`); then rank 0 raises the error, naming the rank it came from, and the
other ranks raise it too (so that no rank goes on alone) but print nothing when it reaches the top of the
process: their exit status still says that they failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lightning_scape.comm.exit_report import quiet_on_this_rank


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if ``what`` failed on any rank, so that no rank goes on alone (and hangs).

    Rank 0 raises its own error, or one that names the first rank that failed and its error; the other ranks
    raise as well, but their errors are not printed when they end the process (:func:`quiet_on_this_rank`).

    Args:
        error: This rank's failure, or None.
        what: The operation, for the message of rank 0 when it did not fail itself.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    world_size = dist.get_world_size()
    messages: list[str | None] = [None] * world_size
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is None:
        error = RuntimeError(
            f"{what} failed on rank {failed[0]} of {world_size}: {messages[failed[0]]}\nEvery rank stops; "
            "nothing was loaded or changed."
        )
    elif dist.get_rank() == 0 and world_size > 1 and hasattr(error, "add_note"):  # Python 3.10 has no notes
        error.add_note(
            f"(lightning_scape: {what} failed on {_ranks(failed)} of {world_size}; every rank stops, this one reports.)"
        )
    if dist.get_rank() != 0:
        quiet_on_this_rank(error)
    raise error


@contextmanager
def agreed(what: str) -> Iterator[None]:
    """Run the block on every rank, then :func:`agree` on its outcome (an error on any rank stops all)."""
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # handed to agree, which raises it again (on rank 0, printed)
        error = exc
    agree(error, what)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
