"""The engine on real gloo process groups (2 and 4 CPU processes), against references and the simulation."""

from __future__ import annotations

import select
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    PYTHON,
    child_env,
    gloo_mass_worker,
    gloo_run_worker,
    gloo_sliced_collectives_worker,
    reference_dense_adams,
    rel_err,
    run_gloo,
    run_worker,
)

from lightning_scape import ScapeConfig, simulate
from lightning_scape.examples.workloads import free_port

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world_size", [2, 4])
def test_density_one_matches_data_parallel_adams(world_size: int) -> None:
    spec = {
        "steps": 20,
        "config": {"density": 1.0, "chunk_size": 32, "dense_warmup_steps": 0, "exploration": 0.0},
    }
    ref = reference_dense_adams(spec, world_size)
    for out in run_gloo(world_size, gloo_run_worker, spec):
        for step in range(20):
            err = rel_err(out["params"][step], ref[step])
            assert err < 1e-6, (step, err)


@pytest.mark.parametrize(("world_size", "dtype"), [(2, "float32"), (4, "float64")])
def test_low_density_run_replicas_counters_and_simulation(world_size: int, dtype: str) -> None:
    W = world_size
    spec: dict[str, Any] = {
        "steps": 8,
        "dtype": dtype,
        "max_grad_norm": 1.0,
        "config": {"density": 0.01, "chunk_size": 512, "dense_warmup_steps": 2, "density_ramp_steps": 0},
    }
    real = run_gloo(W, gloo_run_worker, spec)
    # 1. Replicas bitwise identical after every step.
    for step in range(8):
        for r in range(1, W):
            assert torch.equal(real[0]["params"][step], real[r]["params"][step]), (step, r)
    # 2. Counters equal docs/algorithm.md section 5 (sharded, R = 1) plus the clipping scalar all-reduce.
    cfg = ScapeConfig(**spec["config"])
    b = 8 if dtype == "float64" else 4
    N, dN = real[0]["padded_numel"], real[0]["slots"]
    # Every chunk has the slots of its bucket's chunk size (this tiny net's buckets, padded over 5% at 512, get
    # chunks sized to them: docs/algorithm.md section 3).
    assert dN == sum(P // C * cfg.slots_for(C) for P, C in real[0]["layout"]) and N / real[0]["numel"] <= 1.05
    scalar = 2 * (W - 1) * 4 // W
    for step in range(2, 8):
        sent = real[0]["sent"][step]
        assert sent["values"] + sent["params"] + sent["indices"] == (W - 1) * dN * (b + b + 2) // W
        assert sent["scalars"] == scalar and sent["dense"] == 0
    assert real[0]["sent"][0]["dense"] == (W - 1) * N * 2 * b // W
    # 3. The W-rank simulation produces the same parameters as the real run.
    simulated = simulate(W, lambda rank, comm: run_worker(rank, comm, spec))
    for step in range(8):
        if W == 2:  # one addition per value: bitwise
            assert torch.equal(simulated[0]["params"][step], real[0]["params"][step]), step
        else:  # gloo may associate a 4-way sum differently: last-bit differences in the averaged values, which
            # the interval update's second-moment estimate (g^2/tau - (tau-1) m^2, nearly equal terms for a steady
            # coordinate) can raise to ~1e-8 relative in fp64
            torch.testing.assert_close(simulated[0]["params"][step], real[0]["params"][step], rtol=1e-6, atol=1e-8)
            assert all(
                torch.equal(a, b)
                for a, b in zip(simulated[0]["masks_used"][-1], real[0]["masks_used"][-1], strict=True)
            )


def test_int8_wire_over_gloo_equals_the_simulation_bitwise() -> None:
    """uint8 packets through gloo's sliced all-to-all and all-gather: replicas equal, and the same parameters and
    bytes as the simulation (each packet decoded and summed in rank order on both)."""
    spec: dict[str, Any] = {
        "steps": 8,
        "max_grad_norm": 1.0,
        "config": {
            "density": 0.05,
            "chunk_size": 64,
            "dense_warmup_steps": 2,
            "density_ramp_steps": 2,
            "wire_format": "int8",
        },
    }
    real = run_gloo(2, gloo_run_worker, spec)
    simulated = simulate(2, lambda rank, comm: run_worker(rank, comm, spec))
    for step in range(8):
        assert torch.equal(real[0]["params"][step], real[1]["params"][step]), step
        assert torch.equal(real[0]["params"][step], simulated[0]["params"][step]), step
    assert real[0]["sent"] == simulated[0]["sent"]


def test_no_gradient_mass_is_lost_over_gloo() -> None:
    results = run_gloo(2, gloo_mass_worker, 10)
    for r in results:
        assert torch.equal(r["grad_sum"], r["sent"] + r["residual"])
    assert torch.equal(sum(r["grad_sum"] for r in results), sum(r["sent"] + r["residual"] for r in results))


def test_gloo_collectives_in_slices_move_what_one_message_moves() -> None:
    # Slices of 20 bytes: 37 fp32 values per peer in 8 slices (the last one short), 58 index bytes in 3. (One
    # slice, the case of every small bucket, is what every other gloo test runs.)
    for out in run_gloo(3, gloo_sliced_collectives_worker, 20):
        assert out == {"reduce_scatter": True, "all_gather": True, "int16": True}


# Rank 0 reaches its exit with an all-gather in flight, which rank 1 launches only once rank 0 is there (a key rank 0
# sets in the store from its first exit hook). The collective must be waited on, and gloo's worker threads joined,
# before the interpreter finalizes: a gloo thread that frees the collective's tensors then aborts the process
# (SIGABRT, "terminate called without an active exception"; 21 of 30 such pairs of processes without the exit hook,
# 0 of 30 with it), and without the wait rank 0 never holds rank 1's values. No timeout ends a wait: a rank that
# waits for a collective its peer never launches (modes "fail" and "abandon") never gets past it.
_EXIT_WITH_A_COLLECTIVE_IN_FLIGHT = """
import sys
import atexit, time
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_scape.comm import ProcessGroupCommunicator, abandon_in_flight
rank, mode = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(hours=1))
store = dist.distributed_c10d._get_default_store()
out = torch.zeros(2 * 1000)
atexit.register(  # registered first, so it runs last
    lambda: print(f"held at exit: {out.view(2, -1)[:, 0].tolist()}, groups left: {dist.is_initialized()}", flush=True)
)
if rank == 1:
    if mode in ("fail", "abandon"):
        time.sleep(24 * 3600)  # rank 1 never launches the all-gather (the test kills it)
    if mode == "ok":
        store.wait(["rank 0 is exiting"])
pending = ProcessGroupCommunicator(timeout_s=24 * 3600).all_gather(out, torch.full((1000,), rank + 0.5))
if mode == "waited_then_abandoned":  # a failure after the last collective: a refused checkpoint, say
    pending.wait()
    if rank == 0:
        abandon_in_flight()
if rank == 0:
    atexit.register(lambda: store.set("rank 0 is exiting", "1"))  # registered last, so it runs first
if mode == "fail":
    raise ValueError("the training loop failed")
if mode == "abandon":  # what a strategy's teardown after a failure calls
    abandon_in_flight()
"""
# How long a test waits for a line that a process prints within seconds: only a process that hangs takes longer.
HANG_S = 300


def _launch_pair(mode: str) -> list[subprocess.Popen[str]]:
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return [
        subprocess.Popen(
            [PYTHON, "-c", _EXIT_WITH_A_COLLECTIVE_IN_FLIGHT, str(rank), mode],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]


def test_a_process_waits_at_exit_for_its_collectives_in_flight() -> None:
    procs = _launch_pair("ok")
    outs = [p.communicate(timeout=HANG_S) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        # Waited on, and the process group destroyed (gloo's threads joined) before the interpreter finalizes.
        assert "held at exit: [0.5, 1.5], groups left: False" in stdout, (stdout, stderr[-3000:])


def test_a_failed_process_with_nothing_in_flight_destroys_its_groups_at_exit() -> None:
    """Nothing to wait for: the process groups go before the interpreter finalizes, gloo's threads with them."""
    procs = _launch_pair("waited_then_abandoned")
    outs = [p.communicate(timeout=HANG_S) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        assert "held at exit: [0.5, 1.5], groups left: False" in stdout, (stdout, stderr[-3000:])


@pytest.mark.parametrize("mode", ["fail", "abandon"])
def test_a_failing_process_does_not_wait_at_exit(mode: str) -> None:
    rank0, rank1 = _launch_pair(mode)
    try:
        assert rank0.stdout is not None
        # Its last exit hook's line: the communicator's hook has returned, though rank 1 never launched.
        printed, _, _ = select.select([rank0.stdout], [], [], HANG_S)
        held = rank0.stdout.readline() if printed else ""
    finally:
        rank1.kill()  # gloo's own teardown of rank 0 waits for the collective until its peer is gone
        rank1.communicate()
    _, stderr = rank0.communicate(timeout=HANG_S)
    assert held, "the failing rank waited at exit for a collective its peer never launched"
    if mode == "fail":
        assert rank0.returncode == 1 and "ValueError: the training loop failed" in stderr, stderr[-3000:]
    assert held.startswith("held at exit:") and held.rstrip().endswith("groups left: True"), (held, stderr[-3000:])


# A reference cycle holds the process group (as a hook bound to an object that holds a DDP wrapper does), the
# last collective's tensor is dropped in Python while gloo holds it, and a barrier follows: the pattern whose
# worker thread, still alive at finalization, aborted the process there. The garbage collector stays off, so
# that only release_process_groups can free the cycle.
_HELD_BY_A_CYCLE = """
import gc, os, sys
import torch, torch.distributed as dist
from lightning_scape.comm import release_process_groups
gc.disable()
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
class Holder:
    pass
holder = Holder()
holder.me, holder.group = holder, dist.group.WORLD
del holder
x = torch.ones(1 << 16)
work = dist.all_reduce(x, async_op=True)
del work, x
dist.barrier()
def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")
before = gloo_threads()
release_process_groups()
print(f"gloo worker threads: {before} before, {gloo_threads()} after", flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_releasing_the_groups_ends_gloo_threads_that_a_reference_cycle_kept() -> None:
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [PYTHON, "-c", _HELD_BY_A_CYCLE, str(rank)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    for p in procs:
        stdout, stderr = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, stderr[-3000:]
        # dist.destroy_process_group alone leaves them running (the cycle still holds the group).
        before = int(stdout.split("gloo worker threads: ")[1].split()[0])
        assert before > 0 and stdout.strip().endswith("before, 0 after"), (stdout, stderr[-3000:])


# Rank 1 dies before it launches the all-gather rank 0 waits on, under a timeout of 10 minutes.
_PEER_DIES = """
import sys
import os
from datetime import timedelta
import torch, torch.distributed as dist
from lightning_scape.comm import ProcessGroupCommunicator
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(hours=1))
dist.barrier()
if rank == 1:
    os._exit(3)
try:
    ProcessGroupCommunicator(timeout_s=600).all_gather(torch.zeros(2000), torch.ones(1000)).wait()
except RuntimeError as exc:
    print(str(exc).splitlines()[0], flush=True)
    os._exit(0)
"""


def test_a_peer_that_dies_is_reported_with_the_time_waited_not_the_timeout() -> None:
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [PYTHON, "-c", _PEER_DIES, str(rank)], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=HANG_S) for p in procs]
    assert procs[1].returncode == 3
    stdout, stderr = outs[0]
    assert procs[0].returncode == 0, stderr[-3000:]
    # gloo reports the closed connection long before the 600 s timeout: the message says it failed, and after
    # how long, and names the timeout as a bound (not as the time it took).
    assert "SCAPE collective all_gather" in stdout and " failed after " in stdout, stdout
    assert "s of waiting (the timeout is 600 s)" in stdout and "timed out" not in stdout, stdout
