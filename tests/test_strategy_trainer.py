"""The Trainer's ScapeStrategy on two gloo processes, against bare-engine references.

One launch of ``_lightning_worker.py trainer`` runs every Trainer configuration; each test reads its part.
The references (``_lightning_common.reference``) drive :class:`ScapeEngine` directly in two simulated
ranks, so bitwise equality means the adapter added nothing and lost nothing.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _lightning_common import SCAPE, load_outputs, reference
from _lightning_runs import trainer_other_world_runs, trainer_runs

from lightning_scape import ScapeConfig

pytestmark = pytest.mark.dist


def runs(name: str) -> list[Any]:
    return load_outputs(trainer_runs(), name)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def assert_plain_replicas(out: list[dict[str, Any]]) -> None:
    """No DDP wrapper, the injected DistributedSampler, SCAPE's optimizer, identical replicas."""
    for o in out:
        assert not o["ddp_wrapped"]
        assert o["sampler"] == "DistributedSampler"
        assert o["optimizer_type"] == "ScapeOptimizer"
    assert torch.equal(out[0]["params"], out[1]["params"])


def test_registered_name_with_default_configuration() -> None:
    out = runs("default")
    assert_plain_replicas(out)
    assert out[0]["config"] == ScapeConfig()
    # Two steps of the default configuration are dense warm-up: only dense traffic, as its formula says.
    sent = out[0]["steps"][0]["sent"]
    assert sent["values"] == sent["params"] == sent["indices"] == 0 and sent["dense"] > 0


def test_accumulation_clipping_schedule_and_validation_match_the_engine() -> None:
    out = runs("main")
    assert_plain_replicas(out)
    ref = reference(accumulate=2, max_norm=0.5)
    for r in range(2):
        assert torch.equal(out[r]["params"], ref[r]["params"])
        for key in ("momentum", "residual"):
            assert torch.equal(out[r]["engine"][key], torch.cat([b[key] for b in ref[r]["engine"]["buckets"]]))
    # 16 samples per rank, batches of 4, two epochs, two micro-batches per step: 4 optimizer steps.
    assert out[0]["global_step"] == 4 and out[0]["steps"][-1]["step_count"] == 4
    # The LR schedule reached the engine's param groups (it reads them every step).
    assert out[0]["steps"][-1]["lr"] == pytest.approx([0.02 / 1.4, 0.01 / 1.4])
    assert out[0]["sanity_checked"] and out[0]["val_batches"] == 5  # 1 sanity batch + 2 per epoch
    assert out[0]["val_loss"] == pytest.approx(out[1]["val_loss"])


def test_no_dense_gradient_all_reduce_after_warmup() -> None:
    out = runs("value")
    cfg = ScapeConfig(**SCAPE)
    for o in out:
        for rec in o["steps"]:
            dense = rec["sent"]["dense"]
            assert (dense > 0) == (rec["step_count"] <= cfg.dense_warmup_steps), rec
    # The only all_reduce calls of the whole value-clipping run are scalars (no norm clipping here).
    for numels in load_outputs(trainer_runs(), "all_reduce_value"):
        assert all(n <= 1 for n in numels), numels
    # With MaskMonitor(topk_every_n_steps=2), exactly its measurements all-reduce the dense gradient.
    main = runs("main")[0]
    measured = sum(1 for s in main["steps"] if s["masks"] is not None and s["step_count"] % 2 == 0)
    for numels in load_outputs(trainer_runs(), "all_reduce_main"):
        assert sum(1 for n in numels if n > 8) == measured > 0


def test_clipping_by_value_matches_the_engine() -> None:
    out = runs("value")
    assert_plain_replicas(out)
    ref = reference(clip_value=0.02)
    assert torch.equal(out[0]["params"], ref[0]["params"])


def test_bf16_mixed_matches_the_engine() -> None:
    out = runs("bf16")
    assert_plain_replicas(out)
    ref = reference(autocast=torch.bfloat16)
    assert torch.equal(out[0]["params"], ref[0]["params"])


def test_fp16_inf_step_is_skipped_on_every_rank_without_touching_state() -> None:
    out = runs("fp16")
    assert_plain_replicas(out)
    for o in out:
        steps = o["steps"]
        assert [s["skipped"] for s in steps] == [i == 3 for i in range(8)]
        # The skipped step changed neither parameters nor momentum, residual, masks or step count.
        before, after = steps[2], steps[3]
        assert torch.equal(before["params"], after["params"])
        for key in ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count"):
            assert same(before["engine"][key], after["engine"][key]), key
        # The GradScaler backed off once, on both ranks alike.
        assert [s["scale"] for s in steps] == [256.0] * 3 + [128.0] * 5
    ref = reference(autocast=torch.float16, fp16_scale=256.0, inject_inf_at=3)
    assert ref[0]["skipped"] == [i == 3 for i in range(8)]
    assert torch.equal(out[0]["params"], ref[0]["params"])


def test_compiled_model_matches_the_engine() -> None:
    out = runs("compiled")
    assert_plain_replicas(out)
    ref = reference(epochs=1)
    assert torch.equal(out[0]["params"], ref[0]["params"])


def test_resume_continues_bitwise_identically() -> None:
    whole, resumed = runs("uninterrupted"), runs("resumed")
    assert_plain_replicas(resumed)
    for r in range(2):
        assert torch.equal(whole[r]["params"], resumed[r]["params"])
        for key in ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count", "total_sent"):
            assert same(whole[r]["engine"][key], resumed[r]["engine"][key]), (r, key)
    assert torch.equal(whole[0]["params"], reference(epochs=4)[0]["params"])
    # ModelCheckpoint(save_top_k=1) removed the epoch-0 checkpoint together with its per-rank files.
    files = load_outputs(trainer_runs(), "ckpt_files")[0]
    assert files == ["eepoch=1.ckpt", "eepoch=1.ckpt.scape", "last.ckpt", "last.ckpt.scape",
                     "rank-00000.pt", "rank-00001.pt"]


def test_checkpoint_from_another_configuration_is_refused() -> None:
    for o in runs("other_config"):
        assert o["error"] is not None
        assert "another configuration" in o["error"] and "'density': (0.1, 0.2)" in o["error"]
        assert "Nothing was loaded" in o["error"]


def test_truncated_rank_file_stops_every_rank_before_loading() -> None:
    errors = [o["error"] for o in runs("truncated")]
    assert "rank-00001.pt" in errors[1] and "truncated or corrupt" in errors[1]
    assert "failed on rank 1" in errors[0]  # rank 0's own file was fine; it stops too instead of hanging
    for o in load_outputs(trainer_runs(), "truncated_params"):
        assert torch.equal(o["before"], o["after"])


def test_resume_on_another_world_size_loads_and_trains() -> None:
    """One process resumes the two-process checkpoint (re-sharded; tests/test_reshard_dist.py checks how)."""
    out = trainer_other_world_runs()
    (result,) = load_outputs(out, "one_rank", world_size=1)
    assert result["error"] is None, result
    (params,) = load_outputs(out, "one_rank_params", world_size=1)
    assert not torch.equal(params["before"], params["after"])
    assert os.path.isdir(os.path.join(trainer_runs(), "ckpt", "last.ckpt.scape"))
