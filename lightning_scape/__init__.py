"""lightning_scape: SCAPE extreme-sparse data-parallel training for PyTorch Lightning and Fabric.

The algorithm lives in :class:`ScapeEngine` (``docs/algorithm.md``); :class:`AdamS` is its base
optimizer, usable on its own. Neither needs Lightning: importing this package imports Lightning's adapters (the
strategies, the monitors) only when they are first used, and registers ``strategy="scape"`` with the Trainer and
with Fabric whenever Lightning is loaded (:mod:`lightning_scape.registration`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_scape.adams import AdamS
from lightning_scape.comm import ByteCounters, Communicator, ProcessGroupCommunicator, SoloCommunicator
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.engine.form_switch import set_default_pilot
from lightning_scape.planning.pilot import FormPilot
from lightning_scape.registration import register_with_lightning
from lightning_scape.simulation import simulate
from lightning_scape.warnings import DenseWarmupWarning, OneProcessWarning

if TYPE_CHECKING:
    from lightning_scape import pytorch
    from lightning_scape.fabric import ScapeFSDPStrategy, ScapeStrategy
    from lightning_scape.pytorch.monitors import CommunicationMonitor, MaskMonitor
    from lightning_scape.runtime.optimizer import ScapeOptimizer

# Where a ScapeConfig leaves the wire format and the density unset, the engine chooses them with this pilot.
set_default_pilot(FormPilot)
register_with_lightning()

# The names that need Lightning, and the module each comes from: imported on first use (PEP 562).
_LIGHTNING_NAMES: dict[str, str] = {
    "ScapeStrategy": "lightning_scape.fabric",  # Fabric's; the Trainer's is lightning_scape.pytorch.ScapeStrategy
    "ScapeFSDPStrategy": "lightning_scape.fabric",
    "CommunicationMonitor": "lightning_scape.pytorch.monitors",
    "MaskMonitor": "lightning_scape.pytorch.monitors",
    "ScapeOptimizer": "lightning_scape.runtime.optimizer",
}


def __getattr__(name: str) -> Any:
    if name == "pytorch":
        return importlib.import_module("lightning_scape.pytorch")
    if name in _LIGHTNING_NAMES:
        return getattr(importlib.import_module(_LIGHTNING_NAMES[name]), name)
    raise AttributeError(f"module 'lightning_scape' has no attribute {name!r}")


__version__ = "0.1.0.dev0"

__all__ = [
    "AdamS",
    "ByteCounters",
    "CommunicationMonitor",
    "Communicator",
    "DenseWarmupWarning",
    "FormPilot",
    "MaskMonitor",
    "OneProcessWarning",
    "ProcessGroupCommunicator",
    "ScapeConfig",
    "ScapeEngine",
    "ScapeFSDPStrategy",
    "ScapeOptimizer",
    "ScapeStrategy",
    "SoloCommunicator",
    "__version__",
    "pytorch",
    "simulate",
]
