"""The strategy names ``"scape"``, ``"scape_spawn"`` and ``"scape_fsdp"`` in Lightning's registries."""

from __future__ import annotations

from typing import Any


def register_strategies(cls: type, registry: Any) -> None:
    """Register ``cls`` as ``"scape"`` (started like ``"ddp"``) and ``"scape_spawn"`` (like ``"ddp_spawn"``)."""
    for name, start_method in (("scape", "popen"), ("scape_spawn", "spawn")):
        description = f"SCAPE sparse data parallelism with start_method={start_method!r}"
        _register(registry, name, cls, description=description, start_method=start_method)


def register_fsdp_strategy(cls: type, registry: Any) -> None:
    """Register ``cls`` as ``"scape_fsdp"``: SCAPE across groups, FSDP2 inside each (started like ``"fsdp"``)."""
    _register(registry, "scape_fsdp", cls, description="SCAPE across groups of shard_size processes, FSDP2 inside each")


def _register(registry: Any, name: str, cls: type, description: str, **init_params: Any) -> None:
    """Register ``cls`` under ``name`` unless this very class is there already (spawned workers import again)."""
    entry = dict.get(registry, name)  # the registry's own get() would instantiate the strategy
    if entry is not None and entry.get("strategy") is cls and entry.get("init_params") == init_params:
        return
    registry.register(name, cls, description=description, override=True, **init_params)
