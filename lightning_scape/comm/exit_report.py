"""One report of a failure per node: errors that another process reports in full end this one quietly.

When a peer dies, every surviving process's collective fails with the same diagnosis, and each would print its own
traceback (tens of lines, once per process). An error marked here prints, when it ends the process, one line (or
nothing) instead of its traceback; the exit status still says the process failed. The marks:

* :func:`report_on_local_rank_zero`: a failed collective. Local rank 0 of each node prints it in full, the node's
  other processes one line each;
* :func:`quiet_on_this_rank`: an error that rank 0 reports for every rank (the ranks agreed on it), printed by no
  other rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

# The attribute an error carries when another process reports it: the line to print instead, or "" for none.
_REPORTED_ELSEWHERE = "_lightning_scape_reported_elsewhere"
_hook_installed = False


def report_on_local_rank_zero(error: BaseException) -> None:
    """Print ``error`` in full on local rank 0 of this node only; another local rank prints one line if it ends
    the process with it (``LOCAL_RANK``, as torchrun and Lightning set it; unset: rank 0)."""
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if local_rank == "0":
        return
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    rank = os.environ.get("RANK", "?")
    _mark(
        error,
        f"lightning_scape: rank {rank} (local rank {local_rank}) stopped: {first}\n"
        "(local rank 0 of this node prints the failure in full)",
    )


def quiet_on_this_rank(error: BaseException) -> None:
    """Print nothing if ``error`` ends this process: rank 0 reports it (the exit status is still 1)."""
    _mark(error, "")


def is_reported_elsewhere(error: BaseException) -> bool:
    """Whether another process reports ``error`` (:func:`report_on_local_rank_zero`, :func:`quiet_on_this_rank`)."""
    return getattr(error, _REPORTED_ELSEWHERE, None) is not None


def _mark(error: BaseException, line: str) -> None:
    global _hook_installed
    setattr(error, _REPORTED_ELSEWHERE, line)
    if not _hook_installed:
        sys.excepthook = _hook(sys.excepthook)
        _hook_installed = True


ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


def _hook(previous: ExceptHook) -> ExceptHook:
    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> object:
        line = getattr(error, _REPORTED_ELSEWHERE, None)
        if line is None:
            return previous(kind, error, tb)
        if line:
            print(line, file=sys.stderr, flush=True)
        return None

    return hook
