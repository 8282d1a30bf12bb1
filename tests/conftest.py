"""Test set-up: one intra-op thread per process, so CPU matmuls are reproducible across runs.

``tests/`` and the repository's root are importable (``import helpers``, ``import benchmarks``) through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``.

Fixtures: the two multi-process launches that several test modules read, each started once per session.

A test module may define ``runs_in_another_process(item) -> bool``: the tests it names are deselected here, not
skipped, because another test runs them in a fresh process (``tests/test_kernels.py``: the interpreted Triton
kernels, when triton was imported compiled first). The fast lane then reports them with the other lane's
deselected tests rather than as hundreds of skips.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from helpers import PYTHON, child_env, launcher_args, run_script

from lightning_scape.examples.workloads import free_port

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests their module says run in another process (``runs_in_another_process``)."""
    kept, elsewhere = [], []
    for item in items:
        runs_elsewhere = getattr(getattr(item, "module", None), "runs_in_another_process", None)
        (elsewhere if runs_elsewhere is not None and runs_elsewhere(item) else kept).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = kept


@pytest.fixture(scope="session")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what ``test_strategy_trainer``'s "trainer" scenarios saved (read by it and
    ``test_monitors``): two processes of ``strategy="scape"``, rank 1 started by Lightning's own launcher."""
    out = str(tmp_path_factory.mktemp("trainer"))
    run_script(
        launcher_args("test_strategy_trainer", "trainer", out),
        timeout_s=300,
        env=child_env(MASTER_PORT=str(free_port())),
    )
    return out


@pytest.fixture(scope="session")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what ``test_strategy_fabric``'s "fabric" scenarios saved (read by it and ``test_monitors``):
    ``torchrun --nproc_per_node=2`` (Lightning's torchelastic environment)."""
    out = str(tmp_path_factory.mktemp("fabric"))
    torchrun = [
        os.path.join(os.path.dirname(PYTHON), "torchrun"),
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        *launcher_args("test_strategy_fabric", "fabric", out),
    ]
    proc = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return out
