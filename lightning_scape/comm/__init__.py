"""Collectives used by the engine, behind one small interface, and the byte counters.

* :mod:`~lightning_scape.comm.base`: :class:`Pending`, :class:`Communicator`, :class:`SoloCommunicator`;
* :mod:`~lightning_scape.comm.process_group`: :class:`ProcessGroupCommunicator` (``torch.distributed``);
* :mod:`~lightning_scape.comm.fault_naming`: :class:`FaultNamingCommunicator` (failures name the rank that
  stopped answering) and the timeout arithmetic of the Lightning strategies;
* :mod:`~lightning_scape.comm.thread_group`: W simulated ranks in one process;
* :mod:`~lightning_scape.comm.counters`: :class:`ByteCounters`, bytes sent per kind of traffic.
"""

from lightning_scape.comm.base import Communicator, Done, Pending, SoloCommunicator
from lightning_scape.comm.counters import (
    KIND_DENSE,
    KIND_INDICES,
    KIND_PARAMS,
    KIND_SCALARS,
    KIND_SETUP,
    KIND_VALUES,
    KINDS,
    ByteCounters,
)
from lightning_scape.comm.fault_naming import FaultNamingCommunicator, make_communicator
from lightning_scape.comm.process_group import ProcessGroupCommunicator
from lightning_scape.comm.thread_group import ThreadGroupCommunicator

__all__ = [
    "KINDS",
    "KIND_DENSE",
    "KIND_INDICES",
    "KIND_PARAMS",
    "KIND_SCALARS",
    "KIND_SETUP",
    "KIND_VALUES",
    "ByteCounters",
    "Communicator",
    "Done",
    "FaultNamingCommunicator",
    "Pending",
    "ProcessGroupCommunicator",
    "SoloCommunicator",
    "ThreadGroupCommunicator",
    "make_communicator",
]
