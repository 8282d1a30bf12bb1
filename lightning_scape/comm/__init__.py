"""Collectives used by the engine, behind one small interface, and the byte counters.

* :mod:`~lightning_scape.comm.base`: :class:`Pending`, :class:`Communicator`, :class:`SoloCommunicator`;
* :mod:`~lightning_scape.comm.process_group`: :class:`ProcessGroupCommunicator` (``torch.distributed``), which
  waits at exit for its collectives still in flight unless :func:`abandon_in_flight` says the run failed;
* :mod:`~lightning_scape.comm.fault_naming`: :class:`FaultNamingCommunicator` (failures name the rank that
  stopped answering, from a heartbeat thread that :func:`stop_heartbeat` ends) and the timeout arithmetic of
  the Lightning strategies;
* :mod:`~lightning_scape.comm.exit_report`: a failure printed in full once per node, the node's other processes
  ending with one line;
* :mod:`~lightning_scape.comm.thread_group`: W simulated ranks in one process;
* :mod:`~lightning_scape.comm.counters`: :class:`ByteCounters`, bytes sent per :data:`Traffic` kind;
* :mod:`~lightning_scape.comm.int8_packets`: the int8 wire format (``ScapeConfig.wire_format``): packets of
  scales and codes, their decoding, and the buffers a recurring collective reuses;
* :mod:`~lightning_scape.comm.wire`: :class:`Wire`, through which the engine launches and counts every collective.
"""

from lightning_scape.comm.base import Communicator, Done, Pending, SoloCommunicator
from lightning_scape.comm.counters import TRAFFIC_KINDS, ByteCounters, Traffic
from lightning_scape.comm.fault_naming import FaultNamingCommunicator, make_communicator, stop_heartbeat
from lightning_scape.comm.process_group import ProcessGroupCommunicator, abandon_in_flight, release_process_groups
from lightning_scape.comm.thread_group import ThreadGroupCommunicator
from lightning_scape.comm.wire import Wire, all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

__all__ = [
    "TRAFFIC_KINDS",
    "ByteCounters",
    "Communicator",
    "Done",
    "FaultNamingCommunicator",
    "Pending",
    "ProcessGroupCommunicator",
    "SoloCommunicator",
    "ThreadGroupCommunicator",
    "Traffic",
    "Wire",
    "abandon_in_flight",
    "all_gather_bytes",
    "all_reduce_bytes",
    "make_communicator",
    "reduce_scatter_bytes",
    "release_process_groups",
    "stop_heartbeat",
]
