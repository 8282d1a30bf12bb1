"""Resuming Fabric and Trainer runs on another number of processes (gloo), against the uninterrupted run.

Three launches: the writing run on 2 processes, and its resumes on 1 and on 4 (``_reshard_worker.py``). With
the same global batch, the 10 steps after the checkpoint must reach within 3% of the uninterrupted run's
mean loss; the state right after loading is compared exactly with the checkpoint's rank files.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import torch
from _reshard_worker import EPOCHS, LR, SAVE_AT, SCAPE, STEPS
from helpers import HERE, PYTHON, child_env, rank_file, run_script

from lightning_scape import ScapeConfig
from lightning_scape.examples.workloads import free_port

pytestmark = pytest.mark.dist

WORKER = os.path.join(HERE, "_reshard_worker.py")


def _torchrun(nproc: int, *args: str) -> None:
    torchrun = [os.path.join(os.path.dirname(PYTHON), "torchrun"), f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", WORKER, *args]  # fmt: skip
    proc = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=420, cwd=HERE)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def reshard_out(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 2-process run, then its resumes on 1 and 4 processes; every rank's outputs in one folder."""
    out = str(tmp_path_factory.mktemp("reshard"))
    _torchrun(2, "write", out)
    run_script([WORKER, "resume", out], timeout_s=300, env=child_env(MASTER_PORT=str(free_port())))
    _torchrun(4, "resume", out)
    return out


def load(out: str, name: str, world_size: int) -> list[Any]:
    return [torch.load(os.path.join(out, f"{name}_w{world_size}_rank{r}.pt"), weights_only=False)
            for r in range(world_size)]  # fmt: skip


def global_losses(outs: list[dict[str, Any]]) -> list[float]:
    """Per step, the mean of the ranks' losses: the loss of the global batch (equal parts on every rank)."""
    return [sum(o["losses"][i] for o in outs) / len(outs) for i in range(len(outs[0]["losses"]))]


def rank_files(out: str) -> list[dict[str, Any]]:
    """The SCAPE state each of the 2 writing ranks saved in the Fabric checkpoint."""
    return [
        torch.load(rank_file(os.path.join(out, "fabric.ckpt"), r), weights_only=False)[
            "scape_rank_state"]["optimizers"]["optimizer"]["scape"]
        for r in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 4])
def test_fabric_resume_on_another_world_size_restores_the_state_exactly(reshard_out: str, world_size: int) -> None:
    saved = rank_files(reshard_out)
    outs = load(reshard_out, "fabric", world_size)
    cfg = ScapeConfig(**SCAPE)
    for i, (_, numel, _) in enumerate(saved[0]["layout"]):
        loaded = [o["loaded"] for o in outs]
        new_padded = loaded[0]["padded"][i]
        for key in ("momentum", "last_sent"):
            before = torch.cat([s["buckets"][i][key] for s in saved])  # the two shards, in rank order
            after = torch.zeros(new_padded, dtype=before.dtype)
            for o in loaded:
                after[slice(*o["region"][i])] = o[key][i]
            assert torch.equal(after[:numel], before[:numel]), (i, key)
        # The global unsent gradient (the mean over ranks of the residuals) is unchanged; on 4 ranks each
        # coordinate's new owner holds its old owner's residual, on 1 rank the mean is the residual.
        e0, e1 = (s["buckets"][i]["residual"] for s in saved)
        mean = (e0 + e1)[:numel] / 2
        assert mean.abs().sum() > 0
        after = sum(o["residual"][i] for o in loaded) / world_size
        assert not after[numel:].any()
        if world_size == 1:
            assert torch.equal(after[:numel], mean)
        else:  # the rest of the mass, 4 E - e_owner, is rounded once in fp32
            torch.testing.assert_close(after[:numel], mean, rtol=1e-6, atol=1e-7)
            owned = torch.zeros(new_padded)
            for o in loaded:
                owned[slice(*o["shard"][i])] = o["residual"][i][slice(*o["shard"][i])]
            assert torch.equal(owned[:numel], torch.cat([e0[: len(e0) // 2], e1[len(e1) // 2 :]])[:numel])
        # New masks on the new layout, the same on every rank; on 4 ranks the old owners' statistics give back
        # the mask the uninterrupted run built for the next step.
        masks = [o["masks"][i] for o in loaded]
        assert masks[0].shape == (new_padded // cfg.chunk_size, cfg.slots_per_chunk)
        assert all(torch.equal(m, masks[0]) for m in masks)
        if world_size > 1:
            rows = min(len(masks[0]), len(saved[0]["buckets"][i]["masks"][0]))
            assert torch.equal(masks[0][:rows], saved[0]["buckets"][i]["masks"][0][:rows])
    # The step continues; the byte counters continue those of old rank min(r, 1) plus the rebuilt masks' indices.
    rebuild = sum((world_size - 1) * p // world_size // cfg.chunk_size * cfg.slots_per_chunk * 2
                  for p in outs[0]["loaded"]["padded"])  # fmt: skip
    for r, o in enumerate(outs):
        assert o["loaded"]["step_count"] == SAVE_AT and o["checkpoint_world_size"] == 2
        assert o["loaded"]["refresh_count"] == saved[0]["refresh_count"]
        expected = dict(saved[min(r, 1)]["counters"]["total_sent"])
        expected["indices"] += rebuild
        assert o["loaded"]["total_sent"] == expected
        assert torch.equal(o["params"], outs[0]["params"])  # replicas identical after the continuation


@pytest.mark.parametrize("world_size", [1, 4])
def test_fabric_continuation_matches_the_uninterrupted_run(reshard_out: str, world_size: int) -> None:
    whole = global_losses(load(reshard_out, "fabric", 2))[SAVE_AT:]
    resumed = global_losses(load(reshard_out, "fabric", world_size))
    assert len(whole) == len(resumed) == STEPS - SAVE_AT
    mean_whole, mean_resumed = sum(whole) / len(whole), sum(resumed) / len(resumed)
    print(f"fabric 2 -> {world_size}: mean loss of next 10 steps {mean_resumed:.5f} (uninterrupted {mean_whole:.5f})")
    assert abs(mean_resumed - mean_whole) <= 0.03 * mean_whole
    # The scheduler's position came with the checkpoint.
    assert load(reshard_out, "fabric", world_size)[0]["lr"] == pytest.approx([LR / (1 + 0.02 * STEPS)] * 2)


@pytest.mark.parametrize("world_size", [1, 4])
def test_trainer_continuation_matches_the_uninterrupted_run(reshard_out: str, world_size: int) -> None:
    whole, resumed = load(reshard_out, "trainer", 2), load(reshard_out, "trainer", world_size)

    def per_step(outs: list[dict[str, Any]]) -> dict[int, float]:
        return {step: sum(o["steps"][j][1] for o in outs) / len(outs) for j, (step, _) in enumerate(outs[0]["steps"])}

    whole_steps, resumed_steps = per_step(whole), per_step(resumed)
    last = EPOCHS * 4
    assert sorted(resumed_steps) == list(range(SAVE_AT + 1, last + 1))  # global steps continue after the checkpoint
    for o in resumed:
        assert o["loaded"] == {"step_count": SAVE_AT, "global_step": SAVE_AT}
        assert o["global_step"] == o["step_count"] == last
        assert torch.equal(o["params"], resumed[0]["params"])
    nxt = range(SAVE_AT + 1, SAVE_AT + 11)
    mean_whole = sum(whole_steps[s] for s in nxt) / 10
    mean_resumed = sum(resumed_steps[s] for s in nxt) / 10
    print(f"trainer 2 -> {world_size}: mean loss of next 10 steps {mean_resumed:.5f} (uninterrupted {mean_whole:.5f})")
    assert abs(mean_resumed - mean_whole) <= 0.03 * mean_whole


def test_refusals_name_what_differs_and_load_nothing(reshard_out: str) -> None:
    (other,) = load(reshard_out, "fabric_other_config", 1)
    assert other["error"] is not None and "'density': (0.1, 0.2)" in other["error"], other
    assert "Nothing was loaded" in other["error"]
    assert not other["changed"] and other["step_count"] == 0
    # Every one of the 4 ranks reads the old rank 1's file, and stops.
    for o in load(reshard_out, "fabric_truncated", 4):
        assert o["error"] is not None and "rank-00001.pt" in o["error"] and "truncated or corrupt" in o["error"], o
        assert not o["changed"] and o["step_count"] == 0
