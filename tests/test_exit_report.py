"""A failure is printed in full once per node: the node's other processes end with one line, and with status 1."""

from __future__ import annotations

import subprocess
import sys

from helpers import child_env

_FAILS = """
from lightning_scape.comm.exit_report import report_on_local_rank_zero
error = RuntimeError("SCAPE collective all_gather on rank 3 of 4 (gloo) failed after 0.2 s\\nSCAPE diagnosis: rank 2")
report_on_local_rank_zero(error)
raise error
"""


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _FAILS], env=child_env(**env), capture_output=True, text=True, timeout=60
    )


def test_local_rank_zero_prints_the_failure_in_full() -> None:
    proc = _run(LOCAL_RANK="0", RANK="2")
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback (most recent call last)") == 1 and "SCAPE diagnosis: rank 2" in proc.stderr


def test_another_local_rank_ends_with_one_line() -> None:
    proc = _run(LOCAL_RANK="1", RANK="3")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "lightning_scape: rank 3 (local rank 1) stopped: SCAPE collective all_gather on rank 3 of 4 (gloo) failed "
        "after 0.2 s",
        "(local rank 0 of this node prints the failure in full)",
    ]


def test_without_a_launcher_the_process_prints_in_full() -> None:
    proc = _run()  # no LOCAL_RANK: a process started by hand is its node's only one
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
