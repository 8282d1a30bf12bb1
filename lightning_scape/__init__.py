"""lightning_scape: SCAPE extreme-sparse data-parallel training for PyTorch Lightning and Fabric.

The algorithm lives in :class:`ScapeEngine` (``docs/algorithm.md``); :class:`AdamS` is its base
optimizer, usable on its own.
"""

from lightning_scape.adams import AdamS
from lightning_scape.comm import ByteCounters, Communicator, ProcessGroupCommunicator, SoloCommunicator
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.simulation import simulate

__version__ = "0.1.0.dev0"

__all__ = [
    "AdamS",
    "ByteCounters",
    "Communicator",
    "ProcessGroupCommunicator",
    "ScapeConfig",
    "ScapeEngine",
    "SoloCommunicator",
    "__version__",
    "simulate",
]
