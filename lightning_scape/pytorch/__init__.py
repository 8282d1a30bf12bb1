"""SCAPE for the Lightning Trainer: :class:`ScapeStrategy`, :class:`ScapeFSDPStrategy` and the monitoring callbacks.

``import lightning_scape`` registers ``Trainer(strategy="scape")`` and ``"scape_fsdp"``; this package holds the
Trainer's strategy classes (Fabric's are :class:`lightning_scape.ScapeStrategy` and
:class:`lightning_scape.ScapeFSDPStrategy`).
"""

from lightning_scape.pytorch.fsdp_strategy import ScapeFSDPStrategy
from lightning_scape.pytorch.monitors import CommunicationMonitor, MaskMonitor
from lightning_scape.pytorch.strategy import ScapeStrategy

__all__ = ["CommunicationMonitor", "MaskMonitor", "ScapeFSDPStrategy", "ScapeStrategy"]
