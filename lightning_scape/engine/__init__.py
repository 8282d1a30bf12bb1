"""The SCAPE engine: gradient synchronisation and AdamS stepping for one data-parallel group.

:class:`ScapeEngine` (:mod:`~lightning_scape.engine.scape_engine`) is the one place where the algorithm
lives; the modules beside it hold one mechanism each, in dependency order:

* :mod:`~lightning_scape.engine.layout`: the geometry of buckets, shards and chunks;
* :mod:`~lightning_scape.engine.buckets`: each bucket's tensors;
* :mod:`~lightning_scape.engine.feedback`: error feedback and compaction;
* :mod:`~lightning_scape.engine.update`: the dense and interval updates and their hyperparameters;
* :mod:`~lightning_scape.engine.masks`: the mask schedule;
* :mod:`~lightning_scape.engine.waiting`: the saved state of parameters frozen when a state loads, kept for them;
* :mod:`~lightning_scape.engine.joining`: parameters joining the engine, at construction and when unfrozen later;
* :mod:`~lightning_scape.engine.step`: one step in flight (launches, waits, norm, finiteness);
* :mod:`~lightning_scape.engine.state`: checkpoints and re-sharding.
"""

from lightning_scape.engine.buckets import BucketState
from lightning_scape.engine.scape_engine import ScapeEngine

__all__ = ["BucketState", "ScapeEngine"]
