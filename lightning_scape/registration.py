"""``strategy="scape"`` registered with Lightning whenever Lightning is loaded, before or after this package.

The algorithm (``engine``, ``comm``, ``kernels``, ``planning``) runs without Lightning, so ``import lightning_scape``
does not import it. The strategy names still have to be in Lightning's registries by the time a ``Trainer`` or a
``Fabric`` reads them. Once Lightning's package has loaded (at once if it has; otherwise through an import hook, a
:class:`importlib.abc.MetaPathFinder` that lets Python load ``lightning.fabric`` / ``lightning.pytorch`` as usual and
then registers), each name is registered with a function that imports the adapter and builds the strategy: the
adapters are not imported from inside Lightning's own import, where a module of this package that imports Lightning
may itself be half-loaded. An adapter, once imported, registers its classes in their place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

from lightning_scape.runtime import registry

# Lightning's package: the module of its strategy registry, the registry's name there, and SCAPE's adapter for it.
ADAPTERS: dict[str, tuple[str, str, str]] = {
    "lightning.fabric": ("lightning.fabric.strategies", "STRATEGY_REGISTRY", "lightning_scape.fabric"),
    "lightning.pytorch": ("lightning.pytorch.strategies", "StrategyRegistry", "lightning_scape.pytorch"),
}


def register_with_lightning() -> None:
    """Register the strategy names with each Lightning package loaded now, and with the others when they load."""
    waiting = {name for name in ADAPTERS if not _loaded(name)}
    for name in ADAPTERS.keys() - waiting:
        register_in(name)
    if waiting and not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightning(waiting))


def register_in(package: str) -> None:
    """Register the strategy names in the registry of the Lightning ``package`` (``"lightning.fabric"``, ...)."""
    registry_module, registry_name, adapter = ADAPTERS[package]
    registry.register_builders(adapter, getattr(importlib.import_module(registry_module), registry_name))


def _loaded(name: str) -> bool:
    """Whether the module ``name`` has finished loading (not only begun: its ``__init__`` may be running)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched Lightning package it returns the spec the other finders give, its
    loader wrapped so that the strategy names are registered once the package has loaded."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        self.waiting.discard(fullname)  # once: a second import finds the loaded module
        spec.loader = _LoadThenRegister(spec.loader, fullname)
        return spec


def _spec_from_other_finders(
    skip: object, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is skip or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _LoadThenRegister(importlib.abc.Loader):
    """The package's own loader, then the registration of the strategy names in its registry."""

    def __init__(self, loader: importlib.abc.Loader, package: str) -> None:
        self.loader = loader
        self.package = package

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        register_in(self.package)

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...: the package's loader's
        return getattr(self.loader, name)
