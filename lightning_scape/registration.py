"""``strategy="scape"`` registered with Lightning whenever Lightning is loaded, before or after this package.

The algorithm (``engine``, ``comm``, ``kernels``, ``planning``) runs without Lightning, so ``import lightning_scape``
does not import it. The strategy names still have to be in Lightning's registries by the time a ``Trainer`` or a
``Fabric`` reads them: the adapters register them when they are imported, and this module imports the adapters as
soon as Lightning's own package has loaded (at once if it has; otherwise through an import hook, a
:class:`importlib.abc.MetaPathFinder` that lets Python load ``lightning.fabric`` / ``lightning.pytorch`` as usual
and then imports the matching adapter).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

# Lightning's package, and the adapter whose import registers SCAPE's strategy names in that package's registry.
ADAPTERS: dict[str, str] = {
    "lightning.fabric": "lightning_scape.fabric",
    "lightning.pytorch": "lightning_scape.pytorch",
}


def register_with_lightning() -> None:
    """Import each adapter whose Lightning package is loaded now, and the others when theirs loads."""
    waiting = {name: adapter for name, adapter in ADAPTERS.items() if not _loaded(name)}
    for name, adapter in ADAPTERS.items():
        if name not in waiting:
            importlib.import_module(adapter)
    if waiting and not any(isinstance(f, _AdapterAfterLightning) for f in sys.meta_path):
        sys.meta_path.insert(0, _AdapterAfterLightning(waiting))


def _loaded(name: str) -> bool:
    """Whether the module ``name`` has finished loading (not only begun: its ``__init__`` may be running)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _AdapterAfterLightning(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched Lightning package it returns the spec the other finders give, its
    loader wrapped so that the adapter is imported once the package has loaded."""

    def __init__(self, waiting: dict[str, str]) -> None:
        self.waiting = waiting

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        adapter = self.waiting.get(fullname)
        if adapter is None:
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        del self.waiting[fullname]  # once: a second import finds the loaded module, and the adapter registered
        spec.loader = _LoadThenImport(spec.loader, adapter)
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


class _LoadThenImport(importlib.abc.Loader):
    """The package's own loader, then the adapter's import."""

    def __init__(self, loader: importlib.abc.Loader, adapter: str) -> None:
        self.loader = loader
        self.adapter = adapter

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        importlib.import_module(self.adapter)

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...: the package's loader's
        return getattr(self.loader, name)
