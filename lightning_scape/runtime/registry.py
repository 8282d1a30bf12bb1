"""The strategy names ``"scape"``, ``"scape_spawn"`` and ``"scape_fsdp"`` in Lightning's registries."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# Each name: the strategy class it builds (in the Fabric and in the Trainer adapter alike), its description, and
# the arguments it is built with (started like "ddp", "ddp_spawn" and "fsdp").
NAMES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "scape": ("ScapeStrategy", "SCAPE sparse data parallelism with start_method='popen'", {"start_method": "popen"}),
    "scape_spawn": (
        "ScapeStrategy",
        "SCAPE sparse data parallelism with start_method='spawn'",
        {"start_method": "spawn"},
    ),
    "scape_fsdp": ("ScapeFSDPStrategy", "SCAPE across groups of shard_size processes, FSDP2 inside each", {}),
}


def register_strategies(cls: type, registry: Any) -> None:
    """Register ``cls`` under the names of its class (``ScapeStrategy``: ``"scape"`` and ``"scape_spawn"``;
    ``ScapeFSDPStrategy``: ``"scape_fsdp"``), in place of whatever was registered under them."""
    for name, (class_name, description, init_params) in NAMES.items():
        if class_name == cls.__name__:
            _register(registry, name, cls, description, init_params)


def register_builders(adapter: str, registry: Any) -> None:
    """Register every name not yet in ``registry`` with a function that imports the ``adapter`` module and builds
    the strategy from it: the names work before the adapter is imported (the adapter then registers its classes)."""
    for name, (class_name, description, init_params) in NAMES.items():
        if dict.get(registry, name) is None:
            _register(registry, name, _builder(adapter, class_name), description, init_params)


def _builder(adapter: str, class_name: str) -> Callable[..., Any]:
    def build(**init_params: Any) -> Any:
        return getattr(importlib.import_module(adapter), class_name)(**init_params)

    build.__qualname__ = f"{adapter}.{class_name}"
    return build


def _register(
    registry: Any, name: str, strategy: Callable[..., Any], description: str, init_params: dict[str, Any]
) -> None:
    """Register ``strategy`` under ``name`` unless it is there already (spawned workers import again)."""
    entry = dict.get(registry, name)  # the registry's own get() would instantiate the strategy
    if entry is not None and entry.get("strategy") is strategy and entry.get("init_params") == init_params:
        return
    registry.register(name, strategy, description=description, override=True, **init_params)
