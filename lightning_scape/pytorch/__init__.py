"""SCAPE for the Lightning Trainer: :class:`ScapeStrategy` and the monitoring callbacks.

``import lightning_scape`` registers ``Trainer(strategy="scape")``; this package holds the Trainer's
strategy class (Fabric's is :class:`lightning_scape.ScapeStrategy`).
"""

from lightning_scape.pytorch.monitors import CommunicationMonitor, MaskMonitor
from lightning_scape.pytorch.strategy import ScapeStrategy

__all__ = ["CommunicationMonitor", "MaskMonitor", "ScapeStrategy"]
