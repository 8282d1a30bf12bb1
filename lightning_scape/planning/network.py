"""The network model: links, the cluster they join, and the time a ring collective takes on them.

A ring collective over W ranks sends, from every rank, the bytes of :mod:`lightning_scape.comm.wire`'s
formulas, in ``2 (W - 1)`` steps (all-reduce) or ``W - 1`` steps (reduce-scatter, all-gather). The ranks
sit node by node on the ring, so with more than one node every node's link to the next node carries what
one rank sends; a ring runs at the pace of its slowest hop, which is that link (the hops within a node are
faster). The time is the bytes over that link's usable bandwidth plus one latency per ring step. On one
node the slowest hop is the link between its processes. ``docs/benchmarks.md`` ("Predicted against
measured") states the model and checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_scape.comm.wire import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

CollectiveKind = Literal["all_reduce", "reduce_scatter", "all_gather"]

# TCP over Ethernet with 1500-byte frames carries 1448 payload bytes in every 1514 on the wire; the TCP
# goodput of the benchmark's links is 94-96% of their rate (docs/benchmarks.md).
DEFAULT_EFFICIENCY = 0.95


@dataclass(frozen=True)
class Link:
    """One direction of a full-duplex link.

    Args:
        bandwidth_bps: The nominal rate in bits per second (``25e9`` for 25 Gbit/s).
        latency_s: One-way latency per message, seconds: what each step of a ring waits beyond the bytes.
            Within a data centre about 5-20 microseconds (RDMA) to 50 (TCP); 0 leaves it out.
        efficiency: The fraction of the rate that carries data (headers, acknowledgements); 0.95 for TCP
            over Ethernet with 1500-byte frames, about 0.97 for RDMA. Measure yours with ``iperf3``.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    efficiency: float = DEFAULT_EFFICIENCY

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:
            raise ValueError(f"Link bandwidth must be > 0 bits/s, got {self.bandwidth_bps!r}; e.g. 25e9 for 25 Gbit/s.")
        if not self.latency_s >= 0:
            raise ValueError(f"Link latency must be >= 0 s, got {self.latency_s!r}.")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link efficiency must lie in (0, 1], got {self.efficiency!r}; 0.95 is TCP's.")

    @property
    def bytes_per_s(self) -> float:
        """The usable bandwidth in bytes per second."""
        return self.bandwidth_bps * self.efficiency / 8


@dataclass(frozen=True)
class Collective:
    """One collective as it leaves one rank.

    Args:
        kind: ``"all_reduce"``, ``"reduce_scatter"`` or ``"all_gather"``.
        traffic: What it carries, one of :data:`lightning_scape.comm.Traffic` (``"dense"``, ``"values"``, ...).
        numel: Elements: the tensor all-reduced, the reduce-scatter's input, the all-gather's input per rank.
        itemsize: Bytes per element.
        count: How many such collectives run one after the other (one per bucket of the same shape).
    """

    kind: CollectiveKind
    traffic: str
    numel: int
    itemsize: int
    count: int = 1

    def bytes_each(self, world_size: int) -> int:
        """Bytes this rank sends in one of them: the package's ring formula (what ``ByteCounters`` count)."""
        if self.kind == "all_reduce":
            return all_reduce_bytes(self.numel, self.itemsize, world_size)
        if self.kind == "reduce_scatter":
            return reduce_scatter_bytes(self.numel, self.itemsize, world_size)
        return all_gather_bytes(self.numel, self.itemsize, world_size)

    def bytes_sent(self, world_size: int) -> int:
        """Bytes this rank sends in all ``count`` of them."""
        return self.count * self.bytes_each(world_size)

    def ring_steps(self, world_size: int) -> int:
        """The steps of the ring, each paying one latency."""
        return (2 if self.kind == "all_reduce" else 1) * (world_size - 1)


@dataclass(frozen=True)
class Cluster:
    """W = ``nodes * procs_per_node`` ranks on a ring, node by node.

    Args:
        nodes: Machines.
        procs_per_node: Ranks per machine (its GPUs).
        link: The ring's slowest hop, which sets its pace: with more than one node, each node's link to the
            network (its NIC, and the network behind it); on one node, the link between its processes
            (NVLink, PCIe, shared memory).
    """

    nodes: int
    procs_per_node: int
    link: Link

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Cluster {name} must be an integer >= 1, got {value!r}.")

    @property
    def world_size(self) -> int:
        """W."""
        return self.nodes * self.procs_per_node

    def seconds_each(self, collective: Collective) -> float:
        """The time one of ``collective`` takes: its bytes over the link, plus one latency per ring step."""
        W = self.world_size
        if W == 1:
            return 0.0
        return collective.bytes_each(W) / self.link.bytes_per_s + collective.ring_steps(W) * self.link.latency_s

    def seconds(self, collective: Collective) -> float:
        """The time all ``count`` of ``collective`` take, one after the other."""
        return collective.count * self.seconds_each(collective)

    def with_bandwidth(self, bandwidth_bps: float) -> Cluster:
        """The same cluster on a link of another rate (for the break-even search)."""
        link = Link(bandwidth_bps, self.link.latency_s, self.link.efficiency)
        return Cluster(self.nodes, self.procs_per_node, link)
