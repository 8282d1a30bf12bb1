"""The ledger of bytes each rank sends, by kind of traffic, and of the time it waits for collectives.

The bytes are added by :class:`~lightning_scape.comm.wire.Wire`, which launches every collective of the
engine and holds the ring formulas. A ring collective receives as much as it sends, so only sent bytes are kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# The kinds of traffic the counters keep apart; a misspelt kind is a type error.
Traffic = Literal[
    "values",  # compact gradient values (sparse steps)
    "params",  # parameter values at the mask (sharded sparse steps)
    "indices",  # int16 mask indices (partitioned mask refresh)
    "dense",  # dense steps: gradients and parameters
    "scalars",  # gradient-norm and finiteness all-reduces
    "setup",  # rank 0's parameters to every rank, once at construction
    "probe",  # timed all-gathers that measure the link, where SCAPE chooses its form
]
TRAFFIC_KINDS: tuple[Traffic, ...] = get_args(Traffic)


def _zeros() -> dict[Traffic, int]:
    return dict.fromkeys(TRAFFIC_KINDS, 0)


@dataclass
class ByteCounters:
    """Bytes sent by this rank, per kind, for the current step and in total.

    Ring collectives receive exactly as much as they send, so only the sent bytes are kept.
    ``dense_equivalent`` is what DDP's dense all-reduce of the same gradients would have sent:
    ``2 (W-1)/W * N * b`` for the N real (unpadded) parameters. ``wait_s`` is time spent blocked in ``wait``
    (communication not hidden under compute).
    """

    world_size: int = 1
    step_sent: dict[Traffic, int] = field(default_factory=_zeros)
    total_sent: dict[Traffic, int] = field(default_factory=_zeros)
    step_dense_equivalent: int = 0
    total_dense_equivalent: int = 0
    step_wait_s: float = 0.0
    total_wait_s: float = 0.0
    steps: int = 0

    def start_step(self) -> None:
        """Clear the per-step numbers."""
        for k in self.step_sent:
            self.step_sent[k] = 0
        self.step_dense_equivalent = 0
        self.step_wait_s = 0.0

    def add(self, kind: Traffic, nbytes: int) -> None:
        """Count ``nbytes`` sent as ``kind`` this step."""
        self.step_sent[kind] += nbytes
        self.total_sent[kind] += nbytes

    def add_dense_equivalent(self, nbytes: int) -> None:
        """Count ``nbytes`` that DDP would have sent for this step's gradients."""
        self.step_dense_equivalent += nbytes
        self.total_dense_equivalent += nbytes

    def add_wait(self, seconds: float) -> None:
        """Count ``seconds`` spent blocked in a collective's ``wait``."""
        self.step_wait_s += seconds
        self.total_wait_s += seconds

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
            "total_dense_equivalent": self.total_dense_equivalent,
            "total_wait_s": self.total_wait_s,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.total_sent = {**_zeros(), **state["total_sent"]}  # type: ignore[dict-item]
        self.total_dense_equivalent = int(state["total_dense_equivalent"])  # type: ignore[call-overload]
        self.total_wait_s = float(state["total_wait_s"])  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[call-overload]
