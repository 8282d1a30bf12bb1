"""The SCAPE options a strategy accepts, and what it adds to them: how long a collective may wait and how a
checkpoint of other settings loads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_scape.comm.fault_naming import collective_wait_seconds
from lightning_scape.config import OPTION_NAMES, ScapeConfig, options_doc, refuse_removed_options

# The strategies' default ``timeout``: torch's own default process-group timeout.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def resolve_config(config: ScapeConfig | None, options: Mapping[str, Any]) -> ScapeConfig:
    """``config`` (default: :class:`ScapeConfig`) with ``options`` applied; unknown names raise ``TypeError``.

    Args:
        config: A base configuration, or None for the defaults.
        options: :class:`ScapeConfig` field names and values.

    Returns:
        The validated configuration.
    """
    refuse_removed_options(options, "ScapeStrategy")
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(
            f"ScapeStrategy got unexpected argument(s) {unknown}. SCAPE does not wrap the model in "
            "DistributedDataParallel, so DDP options (find_unused_parameters, static_graph, ...) do not apply. "
            f"Valid SCAPE options are {list(OPTION_NAMES)}, or pass config=ScapeConfig(...)."
        )
    base = config if config is not None else ScapeConfig()
    if not isinstance(base, ScapeConfig):
        raise TypeError(f"config must be a lightning_scape.ScapeConfig, got {type(base).__name__}.")
    return base.replace(**options) if options else base


@dataclass(frozen=True)
class RunSettings:
    """What a strategy's arguments add to the :class:`ScapeConfig`: they decide nothing SCAPE computes.

    Attributes:
        timeout_s: How long any collective may wait, SCAPE's and Lightning's: a rank that died or hangs stops the
            others within it, with an error naming that rank (``lightning_scape/comm/fault_naming.py``).
        resume_with_new_config: Whether a checkpoint saved with other SCAPE settings loads, carried into these
            (:class:`~lightning_scape.engine.ScapeEngine`'s argument of that name).
    """

    timeout_s: float
    resume_with_new_config: bool = False

    @classmethod
    def of(cls, timeout: timedelta | None, resume_with_new_config: bool) -> RunSettings:
        """The settings of a strategy's ``timeout`` (None: :data:`DEFAULT_TIMEOUT`) and ``resume_with_new_config``.

        Raises:
            ValueError: ``timeout`` is not a positive ``timedelta`` or ``resume_with_new_config`` not a bool.
        """
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        if not isinstance(timeout, timedelta) or not timeout.total_seconds() > 0:
            raise ValueError(
                f"ScapeStrategy got timeout={timeout!r}; pass a positive datetime.timedelta, e.g. "
                "timedelta(minutes=30) (the default)."
            )
        if not isinstance(resume_with_new_config, bool):
            raise ValueError(
                f"ScapeStrategy got resume_with_new_config={resume_with_new_config!r}; pass True or False."
            )
        return cls(timeout.total_seconds(), resume_with_new_config)

    @property
    def process_group_timeout(self) -> timedelta:
        """Lightning's process-group timeout: as long as the engine's own waits may block.

        The two agree: a gloo or NCCL operation that outlived the engine's wait would keep a failed process from
        exiting, and one that failed first would decide when the error comes (without naming the rank).
        """
        return timedelta(seconds=collective_wait_seconds(self.timeout_s))


# The strategies' own arguments beside the SCAPE options, written once for the four strategies' docstrings.
_STRATEGY_ARGS_DOC = """
    The strategy's own settings:
        timeout: How long any collective may wait, SCAPE's and Lightning's (default 30 minutes): a rank that died
            or hangs stops the others within it, with an error naming that rank. Lower it to fail fast in jobs
            whose steps take seconds; keep it above the longest pause between two steps (evaluation, a checkpoint
            written by one rank).
        resume_with_new_config: Resume a checkpoint saved with other SCAPE settings, on purpose: the weights,
            momentum, last-sent steps and residuals carry over (no gradient mass is lost) and the masks are
            rebuilt for the new settings. ``chunk_size``, ``sharded`` and ``bucket_cap_mb`` must match (they lay
            the state out). False (the default) refuses such a checkpoint, so that a typo cannot change a run
            silently.
"""


def strategy_options_doc() -> str:
    """What the strategies append to their docstrings: the SCAPE options' advice (:func:`options_doc`) and their own
    ``timeout`` and ``resume_with_new_config``."""
    return _STRATEGY_ARGS_DOC + options_doc()
