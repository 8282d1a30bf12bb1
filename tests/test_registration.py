"""The algorithm imports without Lightning, and ``strategy="scape"`` works whichever of the two is imported first."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import child_env

import lightning_scape

# Prints the Lightning modules loaded, then (if asked) what the registries hold and what the strategy names build.
_REGISTRIES = """
import sys
print(sorted(m for m in sys.modules if m == "lightning" or m.startswith("lightning.")))
if "--registries" in sys.argv:
    import lightning as L
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry
    print(sorted(n for n in StrategyRegistry if n.startswith("scape")))
    print(sorted(n for n in STRATEGY_REGISTRY if n.startswith("scape")))
    trainer = L.Trainer(strategy="scape", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    fabric = L.Fabric(strategy="scape", accelerator="cpu", devices=1)
    print(type(trainer.strategy).__module__, type(fabric.strategy).__module__)
"""


def _run(imports: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", imports + _REGISTRIES, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_the_algorithm_imports_without_lightning() -> None:
    loaded = _run(
        "import lightning_scape, lightning_scape.engine, lightning_scape.comm, lightning_scape.kernels\n"
        "import lightning_scape.planning, lightning_scape.simulation, lightning_scape.engine.fsdp_binding\n"
        "import lightning_scape.comm.rank_failures, lightning_scape.planning.run_traffic, lightning_scape.warnings\n"
        "lightning_scape.simulate(1, lambda rank, comm: None)\n"
    )
    assert loaded == ["[]"]


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_scape\nimport lightning\n",
        "import lightning\nimport lightning_scape\n",
        "import lightning_scape.engine\nimport lightning.fabric\nimport lightning_scape\nimport lightning.pytorch\n",
        # a module of the package that imports Lightning: Lightning loads while that module is half-loaded
        "import lightning_scape.runtime.warmup_notice\n",
    ],
    ids=["package-first", "lightning-first", "fabric-between", "from-inside-the-package"],
)
def test_the_strategy_names_are_registered_whichever_is_imported_first(imports: str) -> None:
    _, trainer_names, fabric_names, modules = _run(imports, "--registries")
    assert trainer_names == "['scape', 'scape_fsdp', 'scape_spawn']"
    assert fabric_names == "['scape', 'scape_fsdp', 'scape_spawn']"
    assert modules == "lightning_scape.pytorch.strategy lightning_scape.fabric.strategy"


def test_the_strategies_and_monitors_are_imported_on_first_use() -> None:
    from lightning_scape.fabric import ScapeStrategy as FabricScapeStrategy
    from lightning_scape.pytorch.monitors import CommunicationMonitor

    assert lightning_scape.ScapeStrategy is FabricScapeStrategy
    assert lightning_scape.CommunicationMonitor is CommunicationMonitor
    assert lightning_scape.pytorch.ScapeStrategy.__module__ == "lightning_scape.pytorch.strategy"
    with pytest.raises(AttributeError, match="no attribute 'ScapeStrateg'"):
        lightning_scape.ScapeStrateg  # noqa: B018
