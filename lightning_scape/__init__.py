"""lightning_scape: SCAPE extreme-sparse data-parallel training for PyTorch Lightning and Fabric.

The algorithm lives in :class:`ScapeEngine` (``docs/algorithm.md``); :class:`AdamS` is its base
optimizer, usable on its own.
"""

# Importing the two Lightning adapters registers strategy="scape" with the Trainer and with Fabric.
from lightning_scape import pytorch  # lightning_scape.pytorch.ScapeStrategy: the Trainer's strategy
from lightning_scape.adams import AdamS
from lightning_scape.comm import ByteCounters, Communicator, ProcessGroupCommunicator, SoloCommunicator
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine
from lightning_scape.engine.form_switch import set_default_pilot
from lightning_scape.fabric import ScapeFSDPStrategy, ScapeStrategy  # Fabric's strategies
from lightning_scape.planning.pilot import FormPilot
from lightning_scape.pytorch.monitors import CommunicationMonitor, MaskMonitor
from lightning_scape.simulation import simulate
from lightning_scape.wiring.optimizer import ScapeOptimizer
from lightning_scape.wiring.setup_checks import OneProcessWarning
from lightning_scape.wiring.warmup_notice import DenseWarmupWarning

# Where a ScapeConfig leaves the wire format and the density unset, the engine chooses them with this pilot.
set_default_pilot(FormPilot)

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
