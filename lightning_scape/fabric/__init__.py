"""SCAPE for Lightning Fabric: :class:`ScapeStrategy` (``Fabric(strategy=ScapeStrategy(density=0.01))``).

Importing it registers ``Fabric(strategy="scape")``; the Trainer's mirror is :mod:`lightning_scape.pytorch`.
"""

from lightning_scape.fabric.strategy import ScapeStrategy

__all__ = ["ScapeStrategy"]
