"""Test set-up: one intra-op thread per process, so CPU matmuls are reproducible across runs.

``tests/`` and the repository's root are importable (``import helpers``, ``import benchmarks``) through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``.

Fixtures: the two multi-process launches that several test modules read, each started once per session.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from helpers import PYTHON, child_env, launcher_args, run_script

from lightning_scape.examples.workloads import free_port

torch.set_num_threads(1)


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
