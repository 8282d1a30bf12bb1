"""Fabric's ScapeStrategy on two gloo processes started by torchrun, against bare-engine references.

Also: a rank that dies or stops answering makes the other one stop within the collective timeout, with
an error that names the missing rank and the collective (two "nodes" started by hand, NODE_RANK style).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _lightning_common import load_outputs, reference
from _lightning_runs import fabric_runs, fault_runs

from lightning_scape import ScapeConfig

pytestmark = pytest.mark.dist


def runs(name: str) -> list[Any]:
    return load_outputs(fabric_runs(), name)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


ENGINE_STATE = ("momentum", "residual", "last_sent", "masks", "step_count", "refresh_count")


def test_registered_name_with_default_configuration() -> None:
    for o in runs("f_default"):
        assert o["strategy"] == "ScapeStrategy" and o["config"] == ScapeConfig()
        assert o["wrapped"] == "Sequential"  # the module itself, no DistributedDataParallel
        assert o["sent"]["values"] == 0 and o["sent"]["dense"] > 0  # dense warm-up only


def test_separate_setup_accumulation_and_clipping_match_the_engine() -> None:
    out = runs("f_main")
    assert torch.equal(out[0]["params"], out[1]["params"])
    ref = reference(epochs=4, accumulate=2, max_norm=0.5, shuffle=False)
    assert torch.equal(out[0]["params"], ref[0]["params"])
    # fabric.clip_gradients returns the global norm of the synchronised gradient, before clipping.
    assert out[0]["norms"] == pytest.approx(ref[0]["norms"], rel=1e-6)
    assert out[0]["norms"] == out[1]["norms"]


def test_resume_mid_run_continues_bitwise_identically() -> None:
    whole, resumed = runs("f_uninterrupted"), runs("f_resumed")
    for r in range(2):
        assert torch.equal(whole[r]["params"], resumed[r]["params"])
        for key in ENGINE_STATE:
            assert same(whole[r]["engine"][key], resumed[r]["engine"][key]), (r, key)
    assert torch.equal(whole[0]["params"], reference(epochs=2, max_norm=1.0, shuffle=False)[0]["params"])


def test_checkpoint_from_another_configuration_is_refused_before_loading() -> None:
    for o in runs("f_other_config"):
        assert o["error"] is not None and "'chunk_size': (64, 128)" in o["error"]
    for o in runs("f_other_config_params"):
        assert torch.equal(o["before"], o["after"])


def test_fp16_inf_step_is_skipped_on_every_rank() -> None:
    out = runs("f_fp16")
    for snaps in out:
        assert [s["skipped"] for s in snaps] == [i == 3 for i in range(6)]
        assert [s["scale"] for s in snaps] == [256.0] * 3 + [128.0] * 3
        assert torch.equal(snaps[2]["params"], snaps[3]["params"])
        for key in ENGINE_STATE:
            assert same(snaps[2]["engine"][key], snaps[3]["engine"][key]), key
    ref = reference(epochs=2, autocast=torch.float16, fp16_scale=256.0, inject_inf_at=3, shuffle=False)
    assert torch.equal(out[0][-1]["params"], ref[0]["trace"][5])


def test_compiled_model_matches_the_engine() -> None:
    out = runs("f_compiled")
    ref = reference(epochs=1, shuffle=False)
    assert torch.equal(out[0]["params"], ref[0]["trace"][3])


@pytest.mark.parametrize("victim", ["kill", "hang"])
def test_survivor_stops_within_the_timeout_naming_the_missing_rank(victim: str) -> None:
    result = fault_runs()[victim]
    out = result["output"]
    assert result["returncode"] not in (0, None), out[-3000:]
    assert "SCAPE collective" in out and "rank 0 of 2" in out, out[-3000:]  # the collective that failed
    if victim == "kill":
        assert "rank 1 stopped answering" in out, out[-3000:]
    else:
        assert "rank 1 at #" in out and "never issued this collective" in out, out[-3000:]
    # A dead peer is noticed at once; a silent one after the timeout. Process exit takes a few seconds.
    limit = 10.0 if victim == "kill" else result["timeout"] + 6.0
    assert result["seconds_after_ready"] is not None and result["seconds_after_ready"] < limit, result
