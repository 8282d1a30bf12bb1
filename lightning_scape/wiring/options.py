"""The SCAPE options a strategy accepts, and the process-group timeout that goes with them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from lightning_scape.comm.fault_naming import collective_wait_seconds
from lightning_scape.config import OPTION_NAMES, ScapeConfig


def resolve_config(config: ScapeConfig | None, options: Mapping[str, Any]) -> ScapeConfig:
    """``config`` (default: :class:`ScapeConfig`) with ``options`` applied; unknown names raise ``TypeError``.

    Args:
        config: A base configuration, or None for the defaults.
        options: :class:`ScapeConfig` field names and values.

    Returns:
        The validated configuration.
    """
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


def process_group_timeout(timeout: timedelta | None, config: ScapeConfig) -> timedelta:
    """The process-group timeout: the one given, else how long the engine's own waits may block.

    The two should agree: a gloo or NCCL operation that outlives the engine's wait would keep a failed
    process from exiting, and one that fails first decides when the error comes.
    """
    if timeout is not None:
        return timeout
    return timedelta(seconds=collective_wait_seconds(config.collective_timeout_s))
