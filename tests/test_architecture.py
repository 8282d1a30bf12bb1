"""The package's layers import only downwards, and no class or function outgrows what a reader can hold.

Complexity (ruff C901, at most 10) is enforced by the lint configuration; this file checks what ruff cannot.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Lowest first. A module may import from a lower layer, and from its own folder; never upwards or sideways
# (the Fabric and the Trainer adapters share code only through runtime/, which stands on Lightning Fabric alone).
LAYERS: list[set[str]] = [
    {"kernels"},
    {"config", "adams", "warnings"},
    {"comm"},
    {"engine"},
    {"simulation", "planning"},  # planning: lightning-scape estimate (config, comm and engine; no strategy)
    {"runtime"},
    {"fabric", "pytorch", "registration"},  # registration: imports the adapters when Lightning loads
    {"litgpt"},
    {"examples"},
    {"__init__", "__main__"},
]
LAYER_OF = {name: depth for depth, names in enumerate(LAYERS) for name in names}
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _sources() -> list[tuple[str, Path]]:
    """(the part of the package a file belongs to, the file), each file once (the top-level kernels/ is a link)."""
    out = []
    root = REPO / "lightning_scape"
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        out.append((rel.parts[0] if len(rel.parts) > 1 else rel.stem, p))
    return out


def _imported_parts(tree: ast.AST) -> set[str]:
    """The parts of ``lightning_scape`` a module imports (``from lightning_scape import kernels`` is kernels)."""
    parts: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = node.module.split(".")
            if names[0] != "lightning_scape":
                continue
            if len(names) > 1:
                parts.add(names[1])
            else:
                parts.update(a.name if a.name in LAYER_OF else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names = alias.name.split(".")
                if names[0] == "lightning_scape":
                    parts.add(names[1] if len(names) > 1 else "__init__")
    return parts


SOURCES = _sources()


def test_every_part_of_the_package_has_a_layer() -> None:
    assert {part for part, _ in SOURCES} <= set(LAYER_OF)


@pytest.mark.parametrize(("part", "path"), SOURCES, ids=[str(p.relative_to(REPO)) for _, p in SOURCES])
def test_imports_go_down_the_layers(part: str, path: Path) -> None:
    tree = ast.parse(path.read_text())
    wrong = sorted(
        other for other in _imported_parts(tree) if other != part and LAYER_OF.get(other, len(LAYERS)) >= LAYER_OF[part]
    )
    assert not wrong, f"{path.relative_to(REPO)} ({part}) imports {wrong} from its own layer or above"


@pytest.mark.parametrize(("part", "path"), SOURCES, ids=[str(p.relative_to(REPO)) for _, p in SOURCES])
def test_classes_and_functions_stay_readable(part: str, path: Path) -> None:
    too_long = []
    for node in ast.walk(ast.parse(path.read_text())):
        limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES}.get(type(node))
        if isinstance(node, ast.AsyncFunctionDef):
            limit = MAX_FUNCTION_LINES
        if limit is not None:
            assert isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                too_long.append(f"{node.name}: {lines} lines (at most {limit})")
    assert not too_long, f"{path.relative_to(REPO)}: {too_long}"


# The parts that stand on Lightning Fabric alone, as Lightning's own Fabric does: the Trainer's strategies build on
# them, never the other way round.
FABRIC_LAYER = {"runtime", "fabric"}


def _imports_lightning_pytorch(tree: ast.AST) -> bool:
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return any(m == "lightning.pytorch" or m.startswith("lightning.pytorch.") for m in modules)


@pytest.mark.parametrize(
    "path", [p for part, p in SOURCES if part in FABRIC_LAYER], ids=lambda p: str(p.relative_to(REPO))
)
def test_the_runtime_and_the_fabric_strategies_do_not_import_the_trainer(path: Path) -> None:
    assert not _imports_lightning_pytorch(ast.parse(path.read_text())), f"{path.relative_to(REPO)} imports it"


def test_the_checker_sees_a_violation() -> None:
    """The layer rule itself: an engine module importing a strategy is caught."""
    tree = ast.parse("from lightning_scape.fabric import ScapeStrategy\nfrom lightning_scape import kernels\n")
    assert _imported_parts(tree) == {"fabric", "kernels"}
    assert LAYER_OF["fabric"] > LAYER_OF["engine"] > LAYER_OF["kernels"]
    assert _imports_lightning_pytorch(ast.parse("if True:\n    from lightning.pytorch.core import LightningModule\n"))
    assert not _imports_lightning_pytorch(ast.parse("import lightning.fabric\nfrom lightning_scape import engine\n"))
