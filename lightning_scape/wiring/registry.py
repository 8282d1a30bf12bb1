"""The strategy names ``"scape"`` and ``"scape_spawn"`` in Lightning's registries."""

from __future__ import annotations

from typing import Any


def register_strategies(cls: type, registry: Any) -> None:
    """Register ``cls`` as ``"scape"`` (started like ``"ddp"``) and ``"scape_spawn"`` (like ``"ddp_spawn"``)."""
    for name, start_method in (("scape", "popen"), ("scape_spawn", "spawn")):
        description = f"SCAPE sparse data parallelism with start_method={start_method!r}"
        _register(registry, name, cls, description=description, start_method=start_method)


def _register(registry: Any, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``cls`` under ``name`` unless this very class is there already (spawned workers import again)."""
    entry = dict.get(registry, name)  # the registry's own get() would instantiate the strategy
    if entry is not None and entry.get("strategy") is cls and entry.get("init_params") == init_params:
        return
    registry.register(name, cls, description=description, override=True, **init_params)
