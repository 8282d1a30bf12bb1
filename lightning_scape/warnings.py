"""The warnings SCAPE gives a run, by category (filter them with ``warnings.filterwarnings``)."""

from __future__ import annotations


class DenseWarmupWarning(UserWarning):
    """A schedule that does not fit the run: it never leaves the dense steps, ends inside the density ramp, or sends
    more than a quarter of DDP's bytes (``docs/lightning.md``)."""


class OneProcessWarning(UserWarning):
    """A SCAPE strategy running a single process: it communicates nothing."""
