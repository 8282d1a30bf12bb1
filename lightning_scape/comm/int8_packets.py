"""The int8 wire format: a rank's slice of a collective as one packet of fp32 scales and int8 codes.

A slice of ``n`` fp32 values in groups of ``g`` travels as ``n / g`` fp32 scales followed by ``n`` int8 codes,
padded to a multiple of 4 bytes (so that every packet's scales start aligned): ``packet_bytes(n, g)``. The
values are rounded by :func:`lightning_scape.kernels.round_int8`, which leaves each value's rounding error in
the sender's buffer; a receiver decodes ``q * s`` (:func:`~lightning_scape.kernels.decode_int8`), bit for bit
what every other receiver of the packet decodes.

A collective's buffers are a :class:`Packets`. A sparse step's collectives keep their shapes from step to step
(until the density ramp changes k), so each bucket keeps theirs in a :class:`PacketCache` and reuses them: the
step then allocates nothing for its packets and launches only the rounding, the decoding and the sums (the host
launching many small operations is what an int8 step's time goes to, ``docs/performance.md``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from lightning_scape import kernels
from lightning_scape.comm.base import Pending

# What a decoded collective does with the W slices it received: sum them into the output (a reduce-scatter),
# or add each to its slice of the output (a gather of updates to values every rank already holds).
Decode = Literal["sum", "add"]

# The rounding kernel is compiled for 16-byte aligned tensors (as fresh buffers are): packets whose codes or values
# do not start aligned are written through scratch, so that no variant without aligned accesses is compiled.
_ALIGN = 16
# Packets are written in place, one launch each, where that takes no more launches than rounding them all into
# scratch at once and copying its scales and codes into the packets (three).
_IN_PLACE_SLICES = 3


def packet_bytes(numel: int, group: int) -> int:
    """Bytes of one packet: ``numel / group`` fp32 scales and ``numel`` int8 codes, padded to 4."""
    return 4 * (numel // group) + -(-numel // 4) * 4


def _rows_aligned(*tensors: Tensor) -> bool:
    """Whether every row of these 2-D tensors starts at a multiple of 16 bytes."""
    return all(
        t.data_ptr() % _ALIGN == 0 and (t.shape[0] == 1 or t.stride(0) * t.element_size() % _ALIGN == 0)
        for t in tensors
    )


def packet_views(packets: Tensor, numel: int, group: int) -> tuple[Tensor, Tensor]:
    """The scales ``[rows, numel / group]`` (fp32) and codes ``[rows, numel]`` (int8) of ``[rows, bytes]`` packets,
    as views into them (a packet's length is a multiple of 4, so every row's scales read as fp32 in place)."""
    m = numel // group
    return packets[:, : 4 * m].view(torch.float32), packets[:, 4 * m : 4 * m + numel].view(torch.int8)


class Packets:
    """The buffers of one int8 collective of ``slices`` packets sent and ``world_size`` received.

    Args:
        numel: Values sent, ``slices * n`` with ``n`` a multiple of ``group``.
        group: Values per scale.
        slices: Packets sent (W for an all-to-all, 1 for an all-gather).
        world_size: Packets received.
        device: Where the buffers live.
        keep: Keep the scratch and the decoded values for the next use (a :class:`PacketCache`'s); else they are
            allocated when needed and dropped after, as a one-off collective's temporaries.

    Attributes:
        sent: ``[slices, packet_bytes(n, group)]`` uint8 packets sent; their padding is zero (written once: the
            rounding writes only the scales and codes).
        received: ``[world_size, packet_bytes(n, group)]`` uint8 packets received.
    """

    def __init__(self, numel: int, group: int, slices: int, world_size: int, device: torch.device, keep: bool) -> None:
        n = numel // slices
        self.key = (numel, group, slices, world_size, device)
        self.numel, self.group, self.keep = n, group, keep  # numel and group of one packet
        nbytes = packet_bytes(n, group)
        self.sent = torch.empty(slices, nbytes, dtype=torch.uint8, device=device)
        if nbytes > 4 * (n // group) + n:
            self.sent[:, 4 * (n // group) + n :].zero_()
        self.received = torch.empty(world_size, nbytes, dtype=torch.uint8, device=device)
        # The views are taken once: each is a dispatch on the host, at every use otherwise.
        self._scales, self._codes = packet_views(self.sent, n, group)
        self._received = packet_views(self.received, n, group)
        self._in_place = slices <= _IN_PLACE_SLICES and _rows_aligned(self._scales, self._codes)
        self._rows = list(zip(self._codes, self._scales, strict=True)) if self._in_place else []
        self._scratch: tuple[Tensor, Tensor] | None = None
        self._decoded: Tensor | None = None

    def encode(self, values: Tensor) -> None:
        """Round ``values`` (``[slices * n]``, replaced by their rounding error) into :attr:`sent`."""
        rows = values.view(self.sent.shape[0], self.numel)
        if self._in_place and _rows_aligned(rows):
            for row, (codes, scales) in zip(rows, self._rows, strict=True):
                kernels.round_int8(row, self.group, codes, scales)
            return
        codes, scales = self._scratch or (
            torch.empty(self._codes.shape, dtype=torch.int8, device=values.device),
            torch.empty(self._scales.shape, dtype=torch.float32, device=values.device),
        )
        if self.keep:
            self._scratch = (codes, scales)
        kernels.round_int8(values, self.group, codes.view(-1), scales.view(-1))
        self._scales.copy_(scales)
        self._codes.copy_(codes)

    def decode(self) -> Tensor:
        """``[world_size, n]`` fp32: the values each received packet carries (read in place from the packets)."""
        scales, codes = self._received
        out = self._decoded
        if out is None:
            out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
            self._decoded = out if self.keep else None
        return kernels.decode_int8(codes, scales, out)


class PacketCache:
    """The :class:`Packets` of one recurring collective (a bucket's sparse reduce-scatter, say), reused while the
    shape holds.

    Reuse is safe because a collective is waited for before the same one is launched again: the engine waits for
    every collective of a step (and of a round, :meth:`~lightning_scape.engine.step.StepInFlight.reopen`) before
    it launches the next.
    """

    def __init__(self) -> None:
        self._packets: Packets | None = None

    def get(self, numel: int, group: int, slices: int, world_size: int, device: torch.device) -> Packets:
        """The buffers for this shape: the last ones if it is theirs, else new ones (the density ramp changed k)."""
        packets = self._packets
        if packets is None or packets.key != (numel, group, slices, world_size, device):
            packets = self._packets = Packets(numel, group, slices, world_size, device, keep=True)
        return packets


def packets_for(
    cache: PacketCache | None, numel: int, group: int, slices: int, world_size: int, device: torch.device
) -> Packets:
    """The cache's buffers for this shape, or one-off ones where there is no cache."""
    if cache is None:
        return Packets(numel, group, slices, world_size, device, keep=False)
    return cache.get(numel, group, slices, world_size, device)


def sum_rows(output: Tensor, parts: Tensor) -> None:
    """``output`` = the sum of the rows of ``parts``, added in rank order (so every rank sums alike)."""
    if output.dtype == parts.dtype and len(parts) > 1:
        # The first two rows in one operation: what copying the first and adding the second computes. An output of
        # another dtype copies the first, so that every addition is in its dtype.
        torch.add(parts[0], parts[1], out=output)
        summed = 2
    else:
        output.copy_(parts[0])
        summed = 1
    for part in parts[summed:]:
        output.add_(part)


class DecodeOnWait:
    """A collective of packets in flight; ``wait`` decodes the W received packets into ``output``.

    Args:
        inner: The collective.
        packets: Its buffers: it sends ``packets.sent`` (kept alive until it completes) and receives
            ``packets.received``.
        output: ``"sum"``: ``[n]``, the sum of the W slices in rank order; ``"add"``: ``[W * n]``, each slice
            added to its part.
        how: ``"sum"`` or ``"add"``.
    """

    def __init__(self, inner: Pending, packets: Packets, output: Tensor, how: Decode) -> None:
        self._inner: Pending | None = inner
        self._packets = packets
        self._output, self._how = output, how

    def wait(self) -> None:
        if self._inner is None:
            return
        self._inner.wait()
        self._inner = None
        parts = self._packets.decode()
        if self._how == "add":
            self._output.view(parts.shape).add_(parts)
        else:
            sum_rows(self._output, parts)
