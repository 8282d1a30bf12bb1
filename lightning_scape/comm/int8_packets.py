"""The int8 wire format: a rank's slice of a collective as one packet of fp32 scales and int8 codes.

A slice of ``n`` fp32 values in groups of ``g`` travels as ``n / g`` fp32 scales followed by ``n`` int8 codes,
padded to a multiple of 4 bytes (so that every packet's scales start aligned): ``packet_bytes(n, g)``. The
values are rounded by :func:`lightning_scape.kernels.round_int8`, which leaves each value's rounding error in
the sender's buffer; a receiver decodes ``q * s`` (:func:`~lightning_scape.kernels.decode_int8`), bit for bit
what every other receiver of the packet decodes.
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


def packet_bytes(numel: int, group: int) -> int:
    """Bytes of one packet: ``numel / group`` fp32 scales and ``numel`` int8 codes, padded to 4."""
    return 4 * (numel // group) + -(-numel // 4) * 4


def encode(values: Tensor, group: int, slices: int) -> Tensor:
    """``values`` cut into ``slices`` equal slices, each rounded into one packet.

    Args:
        values: ``[slices * n]`` fp32 values, ``n`` a multiple of ``group``; replaced by their rounding error.
        group: Values per scale.
        slices: Packets to make (W for an all-to-all, 1 for an all-gather).

    Returns:
        ``[slices, packet_bytes(n, group)]`` uint8 packets.
    """
    n = values.numel() // slices
    m = n // group
    codes = torch.empty(values.numel(), dtype=torch.int8, device=values.device)
    scales = torch.empty(slices * m, dtype=torch.float32, device=values.device)
    kernels.round_int8(values, group, codes, scales)
    packets = torch.empty(slices, packet_bytes(n, group), dtype=torch.uint8, device=values.device)
    packets[:, : 4 * m].copy_(scales.view(slices, m).view(torch.uint8))
    packets[:, 4 * m : 4 * m + n].copy_(codes.view(slices, n).view(torch.uint8))
    packets[:, 4 * m + n :].zero_()  # only the padding: the rest was just written
    return packets


def decode(packets: Tensor, numel: int, group: int) -> Tensor:
    """``[W, numel]`` fp32: the values each of the W received packets carries."""
    m = numel // group
    scales = packets[:, : 4 * m].contiguous().view(torch.float32)
    codes = packets[:, 4 * m : 4 * m + numel].contiguous().view(torch.int8)
    return kernels.decode_int8(codes.reshape(-1), scales.reshape(-1)).view(packets.shape[0], numel)


class DecodeOnWait:
    """A collective of packets in flight; ``wait`` decodes the W received packets into ``output``.

    Args:
        inner: The collective.
        received: ``[W, packet_bytes]`` the packets it receives.
        sent: The packets it sends, kept alive until the collective completes.
        output: ``"sum"``: ``[n]``, the sum of the W slices in rank order; ``"add"``: ``[W * n]``, each slice
            added to its part.
        group: Values per scale.
        how: ``"sum"`` or ``"add"``.
    """

    def __init__(self, inner: Pending, received: Tensor, sent: Tensor, output: Tensor, group: int, how: Decode) -> None:
        self._inner: Pending | None = inner
        self._received, self._sent = received, sent
        self._output, self._group, self._how = output, group, how

    def wait(self) -> None:
        if self._inner is None:
            return
        self._inner.wait()
        self._inner = None
        w = self._received.shape[0]
        n = self._output.numel() // (1 if self._how == "sum" else w)
        parts = decode(self._received, n, self._group)
        if self._how == "add":
            self._output.view(w, n).add_(parts)
            return
        self._output.copy_(parts[0])
        for part in parts[1:]:
            self._output.add_(part)
