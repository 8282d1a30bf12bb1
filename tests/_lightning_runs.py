"""The multi-process runs behind the strategy and monitor tests, each launched once per test session.

Starting two Lightning processes costs several seconds, so one launch runs many Trainer or Fabric
runs (see ``_lightning_worker.py``) and every test reads what it needs from the saved outputs.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

from _lightning_common import PYTHON, WORKER, child_env, run_script

from lightning_scape.workloads import free_port

_DIRS: list[str] = []


@atexit.register
def _cleanup() -> None:
    for d in _DIRS:
        shutil.rmtree(d, ignore_errors=True)


def _outdir(name: str) -> str:
    d = tempfile.mkdtemp(prefix=f"scape_{name}_")
    _DIRS.append(d)
    return d


@functools.cache
def trainer_runs() -> str:
    """``python _lightning_worker.py trainer``: Lightning's own launcher starts rank 1 (``strategy="scape"``)."""
    out = _outdir("trainer")
    run_script([WORKER, "trainer", out], timeout_s=300, env=child_env(MASTER_PORT=str(free_port())))
    return out


@functools.cache
def trainer_other_world_runs() -> str:
    """One process resuming the two-process Trainer checkpoint."""
    out = _outdir("trainer_w1")
    ckpt = os.path.join(trainer_runs(), "ckpt", "last.ckpt")
    run_script([WORKER, "trainer_other_world", out, ckpt], timeout_s=120,
               env=child_env(MASTER_PORT=str(free_port())))
    return out


@functools.cache
def fabric_runs() -> str:
    """``torchrun --nproc_per_node=2 _lightning_worker.py fabric`` (Lightning's torchelastic environment)."""
    out = _outdir("fabric")
    torchrun = [os.path.join(os.path.dirname(PYTHON), "torchrun"), "--nproc_per_node=2",
                f"--master_port={free_port()}", WORKER, "fabric", out]
    proc = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return out


@functools.cache
def fault_runs(timeout_kill: float = 30.0, timeout_hang: float = 6.0) -> dict[str, Any]:
    """Two two-"node" jobs started by hand (``NODE_RANK``, ``MASTER_ADDR``), run side by side.

    In one, rank 1 kills itself (SIGKILL) after three steps; in the other it stops issuing collectives.
    Returns, per victim kind, rank 0's exit code, its output, and the seconds from "READY" (printed by
    rank 0 right before the step that cannot complete) to its exit.
    """
    jobs: dict[str, dict[str, Any]] = {}
    for victim, timeout in (("kill", timeout_kill), ("hang", timeout_hang)):
        out = _outdir(f"fault_{victim}")
        port = str(free_port())
        procs = []
        for node in (1, 0):
            env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node),
                            SCAPE_TIMEOUT=str(timeout))
            procs.append(subprocess.Popen([PYTHON, WORKER, "fault", out, victim], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        jobs[victim] = {"procs": procs, "timeout": timeout}

    def watch(job: dict[str, Any]) -> None:  # the survivor's exit time, to the tenth of a second
        try:
            job["output"], _ = job["procs"][1].communicate(timeout=180)
        except subprocess.TimeoutExpired:
            job["procs"][1].kill()
            job["output"], _ = job["procs"][1].communicate()
        job["ended"] = time.time()

    threads = [threading.Thread(target=watch, args=(job,)) for job in jobs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results: dict[str, Any] = {}
    for victim, job in jobs.items():
        victim_proc, survivor = job["procs"]
        victim_proc.kill()
        victim_proc.wait()
        output = job["output"]
        ready = [float(line.split()[1]) for line in output.splitlines() if line.startswith("READY ")]
        results[victim] = {
            "returncode": survivor.returncode,
            "output": output,
            "seconds_after_ready": job["ended"] - ready[0] if ready else None,
            "timeout": job["timeout"],
        }
    return results
