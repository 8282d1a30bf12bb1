"""SCAPE for Lightning Fabric: :class:`ScapeStrategy` (``Fabric(strategy=ScapeStrategy(density=0.01))``) and
:class:`ScapeFSDPStrategy` (FSDP2 inside each group of ``shard_size`` processes, SCAPE across the groups).

Importing it registers ``Fabric(strategy="scape")`` and ``"scape_fsdp"``; the Trainer's mirror is
:mod:`lightning_scape.pytorch`.
"""

from lightning_scape.fabric.fsdp_strategy import ScapeFSDPStrategy
from lightning_scape.fabric.strategy import ScapeStrategy

__all__ = ["ScapeFSDPStrategy", "ScapeStrategy"]
