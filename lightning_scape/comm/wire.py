"""Every collective the engine launches, counted where it is launched.

The engine never calls a :class:`~lightning_scape.comm.base.Communicator` itself: each collective goes
through one method of :class:`Wire`, which adds the bytes this rank sends (the ring formula written beside
the launch, ``docs/algorithm.md`` section 5) to the :class:`~lightning_scape.comm.counters.ByteCounters`
under a :data:`Traffic` kind, then launches it. :meth:`Wire.wait` counts the time a wait blocks; a launch or
wait that raised sets :attr:`Wire.failed`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import Tensor

from lightning_scape.comm.base import Communicator, Pending
from lightning_scape.comm.counters import ByteCounters, Traffic
from lightning_scape.comm.int8_packets import DecodeOnWait, PacketCache, packets_for


def all_reduce_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements: ``2 (W-1)/W n b`` (rounded down)."""
    return (2 * (world_size - 1) * numel * itemsize) // world_size


def reduce_scatter_bytes(input_numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter of a ``W n``-element input: ``(W-1) n b``."""
    return ((world_size - 1) * input_numel * itemsize) // world_size


def all_gather_bytes(input_numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of ``n`` elements per rank: ``(W-1) n b``."""
    return (world_size - 1) * input_numel * itemsize


class Wire:
    """A data-parallel group's collectives, each counted in ``counters`` as it is launched.

    Args:
        comm: The group's collectives.
        counters: The ledger of bytes sent and time waited.
    """

    def __init__(self, comm: Communicator, counters: ByteCounters) -> None:
        self.comm = comm
        self.counters = counters
        self.world_size = comm.world_size
        self.failed = False  # a launch or wait raised: what is in flight may never complete

    def _launch(self, start: Callable[[], Pending]) -> Pending:
        try:
            return start()
        except BaseException:
            self.failed = True
            raise

    def all_reduce_sum(self, kind: Traffic, tensor: Tensor) -> Pending:
        """Sum ``tensor`` over ranks in place; sends ``2 (W-1)/W n b``."""
        self.counters.add(kind, all_reduce_bytes(tensor.numel(), tensor.element_size(), self.world_size))
        return self._launch(lambda: self.comm.all_reduce_sum(tensor))

    def reduce_scatter_sum(self, kind: Traffic, output: Tensor, input: Tensor) -> Pending:
        """``output`` = the sum over ranks of this rank's slice of ``input``; sends ``(W-1)/W`` of ``input``."""
        self.counters.add(kind, reduce_scatter_bytes(input.numel(), input.element_size(), self.world_size))
        return self._launch(lambda: self.comm.reduce_scatter_sum(output, input))

    def all_gather(self, kind: Traffic, output: Tensor, input: Tensor) -> Pending:
        """``output`` = every rank's ``input`` in rank order; sends ``input`` to each of the ``W - 1`` others."""
        self.counters.add(kind, all_gather_bytes(input.numel(), input.element_size(), self.world_size))
        return self._launch(lambda: self.comm.all_gather(output, input))

    def reduce_scatter_int8(
        self, kind: Traffic, output: Tensor, input: Tensor, group: int, cache: PacketCache | None = None
    ) -> Pending:
        """:meth:`reduce_scatter_sum` of ``input`` rounded to int8 (``comm/int8_packets.py``), as an all-to-all of
        packets; ``input`` keeps this rank's rounding error. Sends ``(W-1)/W`` of the packets.

        ``cache``: where this collective's buffers are kept from one launch to the next (a recurring one's);
        None allocates them for this launch only.
        """
        packets = packets_for(cache, input.numel(), group, self.world_size, self.world_size, input.device)
        packets.encode(input)
        sent, received = packets.sent, packets.received
        self.counters.add(kind, reduce_scatter_bytes(sent.numel(), 1, self.world_size))
        pending = self._launch(lambda: self.comm.all_to_all(received.view(-1), sent.view(-1)))
        return DecodeOnWait(pending, packets, output, "sum")

    def all_gather_int8(
        self, kind: Traffic, output: Tensor, input: Tensor, group: int, cache: PacketCache | None = None
    ) -> Pending:
        """Every rank's ``input`` rounded to int8, added to its slice of ``output``; ``input`` keeps this rank's
        rounding error. Sends the packet to each of the ``W - 1`` others. ``cache``: as in
        :meth:`reduce_scatter_int8`."""
        packets = packets_for(cache, input.numel(), group, 1, self.world_size, input.device)
        packets.encode(input)
        sent, received = packets.sent, packets.received
        self.counters.add(kind, all_gather_bytes(sent.numel(), 1, self.world_size))
        pending = self._launch(lambda: self.comm.all_gather(received.view(-1), sent.view(-1)))
        return DecodeOnWait(pending, packets, output, "add")

    def count_dense_equivalent(self, numel: int, itemsize: int) -> None:
        """Count what DDP's all-reduce of ``numel`` gradient elements would send (nothing is launched)."""
        self.counters.add_dense_equivalent(all_reduce_bytes(numel, itemsize, self.world_size))

    def wait(self, pending: Pending) -> None:
        """``pending.wait()``, adding the time it blocked to the counters' ``wait_s``."""
        t0 = time.perf_counter()
        try:
            pending.wait()
        except BaseException:
            self.failed = True
            raise
        self.counters.add_wait(time.perf_counter() - t0)

    def wait_in_order(self, pendings: list[Pending | None]) -> None:
        """:meth:`wait` for each launched collective in list order (None: nothing was launched there)."""
        for pending in pendings:
            if pending is not None:
                self.wait(pending)
