"""Bytes each rank sends, by kind, counted with the ring formulas of ``docs/algorithm.md`` section 5.

Per rank: an all-reduce of n elements sends ``2 (W-1)/W n b`` bytes, a reduce-scatter of a ``W n`` input
``(W-1) n b``, an all-gather of ``n`` per rank ``(W-1) n b``. A ring collective receives as much as it sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lightning_scape.comm.base import Pending

# Kinds of traffic that the counters keep apart.
KIND_VALUES = "values"  # compact gradient values (sparse steps)
KIND_PARAMS = "params"  # parameter values at the mask (sharded sparse steps)
KIND_INDICES = "indices"  # int16 mask indices (partitioned mask refresh)
KIND_DENSE = "dense"  # dense warm-up: gradients and parameters
KIND_SCALARS = "scalars"  # gradient-norm all-reduce and other scalars
KIND_SETUP = "setup"  # rank 0's parameters to every rank, once at construction
KINDS: tuple[str, ...] = (KIND_VALUES, KIND_PARAMS, KIND_INDICES, KIND_DENSE, KIND_SCALARS, KIND_SETUP)


@dataclass
class ByteCounters:
    """Bytes sent by this rank, per kind, for the current step and in total.

    Ring collectives receive exactly as much as they send, so only the sent bytes are kept.
    ``dense_equivalent`` is what DDP's dense all-reduce of the same gradients would have sent:
    ``2 (W-1)/W * N * b`` for the N real (unpadded) parameters. ``wait_s`` is time spent blocked in ``wait``
    (communication not hidden under compute).
    """

    world_size: int = 1
    step_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    total_sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
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

    def _add(self, kind: str, nbytes: int) -> None:
        self.step_sent[kind] += nbytes
        self.total_sent[kind] += nbytes

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
            "total_dense_equivalent": self.total_dense_equivalent,
            "total_wait_s": self.total_wait_s,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.total_sent = dict(state["total_sent"])  # type: ignore[call-overload]
        self.total_dense_equivalent = int(state["total_dense_equivalent"])  # type: ignore[call-overload]
        self.total_wait_s = float(state["total_wait_s"])  # type: ignore[arg-type]
        self.steps = int(state["steps"])  # type: ignore[call-overload]
