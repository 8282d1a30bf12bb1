"""In-process tests of what both strategies share (``lightning_scape.runtime``) and the engine
support they use (fp16 unscaling and skipping, the early global norm, state checks). No process group needed."""

from __future__ import annotations

import logging
import os
import warnings
from datetime import timedelta
from typing import Any

import pytest
import torch
from helpers import LR, SCAPE, flat, make_net, param_groups, random_batch, rank_file, same
from lightning.fabric import Fabric
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_scape
from lightning_scape import AdamS, ScapeConfig, ScapeEngine, ScapeOptimizer, simulate
from lightning_scape.comm import Communicator
from lightning_scape.config import OPTION_NAMES, ScapeOptions
from lightning_scape.runtime import checkpoint_protocol, engine_setup, warmup_notice
from lightning_scape.runtime.lr_notices import CONSTANT_LR_STEPS, ConvertedLrNotices
from lightning_scape.runtime.optimizer import to_adams
from lightning_scape.warnings import DenseWarmupWarning

CFG = ScapeConfig(**SCAPE)

# ------------------------------------------------------------------------------------------ options


@pytest.mark.parametrize("cls", [lightning_scape.ScapeStrategy, lightning_scape.pytorch.ScapeStrategy])
def test_strategy_options_become_one_validated_config(cls: Any) -> None:
    assert cls(density=0.05, chunk_size=128).scape_config == ScapeConfig(density=0.05, chunk_size=128)
    base = ScapeConfig(density=0.2, sharded=False)
    assert cls(config=base, dense_warmup_steps=3).scape_config == base.replace(dense_warmup_steps=3)
    with pytest.raises(TypeError, match=r"\['find_unused_parameters'\].*DistributedDataParallel"):
        cls(find_unused_parameters=True)
    with pytest.raises(ValueError, match="density"):
        cls(density=2.0)
    # One timeout bounds SCAPE's collectives and Lightning's: the process group's is the engine's wait, the
    # timeout less the time the diagnosis takes (three heartbeats of T / 30).
    strategy = cls(timeout=timedelta(seconds=60))
    assert strategy.scape_run.timeout_s == 60.0 and strategy._timeout == timedelta(seconds=54.0)
    assert cls()._timeout == timedelta(seconds=1800 - 6.0)  # 30 minutes, heartbeats every 2 s
    with pytest.raises(ValueError, match=r"positive datetime\.timedelta"):
        cls(timeout=60)
    with pytest.raises(TypeError, match=r"ScapeStrategy has no option 'collective_timeout_s' any more.*timeout="):
        cls(collective_timeout_s=60.0)
    assert cls(resume_with_new_config=True).scape_run.resume_with_new_config


def test_option_names_are_the_config_fields() -> None:
    assert set(ScapeOptions.__annotations__) == set(OPTION_NAMES)


def test_registered_with_fabric_and_trainer_idempotently() -> None:
    for registry, cls in (
        (STRATEGY_REGISTRY, lightning_scape.ScapeStrategy),
        (StrategyRegistry, lightning_scape.pytorch.ScapeStrategy),
    ):
        for name in ("scape", "scape_spawn"):
            assert dict.get(registry, name)["strategy"] is cls
        before = dict(registry)
        cls.register_strategies(registry)  # what a spawned worker's import does again
        assert dict(registry) == before
    fabric = Fabric(strategy="scape", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is lightning_scape.ScapeStrategy and fabric.strategy.scape_config == ScapeConfig()
    trainer = Trainer(
        strategy="scape",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    assert type(trainer.strategy) is lightning_scape.pytorch.ScapeStrategy
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


# --------------------------------------------------------------------------------------- optimizers


def test_adamw_becomes_adams_sharing_its_param_groups() -> None:
    net = make_net()
    adamw = torch.optim.AdamW(param_groups(net, LR), lr=0.02, betas=(0.8, 0.9), eps=1e-6)
    adams = to_adams(adamw)
    assert isinstance(adams, AdamS)
    assert all(a is b for a, b in zip(adams.param_groups, adamw.param_groups, strict=True))
    assert adams.param_groups[1]["lr"] == 0.01 and adams.param_groups[0]["betas"] == (0.8, 0.9)
    assert adams.param_groups[0]["bias_correction"] is True
    adamw.param_groups[0]["lr"] = 0.5  # what an LR scheduler does
    assert adams.param_groups[0]["lr"] == 0.5
    already_adams = AdamS(net.parameters())
    assert to_adams(already_adams) is already_adams


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_converted_adamw_takes_adamws_first_two_steps(betas: tuple[float, float], caplog: Any) -> None:
    """AdamS's normaliser is bias-corrected as Adam's second moment: at step 1 it is |g|, at step 2 the same mix of
    g1^2 and g2^2 as Adam's (the first momentum is g1), so a converted AdamW starts exactly as AdamW. With b2's
    weight on the zero momentum of step 1 it moved every coordinate by lr / sqrt(1 - b2), 31.6 lr at 0.999."""
    torch.manual_seed(0)
    user, twin = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
    twin.load_state_dict(user.state_dict())
    with caplog.at_level(logging.INFO):
        adams = to_adams(torch.optim.AdamW(user.parameters(), lr=1e-3, betas=betas))
    assert "converted AdamW to AdamS" in caplog.text and f"betas={betas}" in caplog.text
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-3, betas=betas)
    for step in range(3):
        grads = [torch.randn_like(p) * 10.0**step for p in user.parameters()]  # a growing gradient
        for opt, net in ((adams, user), (adamw, twin)):
            for p, g in zip(net.parameters(), grads, strict=True):
                p.grad = g.clone()
            opt.step()
        moved = flat(user.parameters()) - flat(twin.parameters())
        if step < 2:
            torch.testing.assert_close(flat(user.parameters()), flat(twin.parameters()), rtol=0, atol=1e-6)
        else:  # from step 3 the normalisers differ: AdamS's is the squared momentum, Adam's its average of g^2
            assert moved.abs().max() > 1e-5


def test_a_converted_lr_above_the_ceiling_is_told_once_before_the_step_that_first_uses_it() -> None:
    def steps(net: torch.nn.Module, opt: ScapeOptimizer, lrs: list[float]) -> list[str]:
        told = []
        for step, lr in enumerate(lrs):
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = random_batch(step, 8)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step(lambda x=x, y=y: torch.nn.functional.mse_loss(net(x), y).backward())
            told += [f"{step}: {w.message}" for w in caught if "is above 0.001" in str(w.message)]
            opt.zero_grad()
        return told

    def converted(factory: Any) -> tuple[torch.nn.Module, ScapeOptimizer]:
        net = make_net()
        return net, engine_setup.build_scape_optimizer(factory(net.parameters()), CFG, net, None)

    # A warm-up to 3e-3: told once, at the first step above 1e-3, naming the value and the one to use.
    (told,) = steps(*converted(lambda p: torch.optim.AdamW(p)), [5e-4, 1e-3, 2e-3, 3e-3, 3e-3])
    assert told.startswith("2: lightning_scape: lr=0.002 (param group 0)") and "AdamW" in told
    assert "Use lr=0.001" in told and "docs/algorithm.md section 2" in told
    assert steps(*converted(lambda p: torch.optim.Adam(p)), [1e-3] * 3) == []  # at the ceiling: nothing
    assert steps(*converted(lambda p: AdamS(p)), [3e-3] * 3) == []  # AdamS chosen by the user: stepped as chosen


def test_unsupported_optimizers_are_refused_with_the_alternatives() -> None:
    net = make_net()
    with pytest.raises(TypeError, match=r"AdamW and torch.optim.Adam .*got torch.optim.sgd.SGD"):
        to_adams(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        to_adams(torch.optim.AdamW(net.parameters(), amsgrad=True))
    stepped = torch.optim.AdamW(net.parameters())
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    stepped.step()
    with pytest.raises(ValueError, match="already holds optimizer state"):
        to_adams(stepped)
    with pytest.warns(UserWarning, match="L2 term"):
        to_adams(torch.optim.Adam(make_net().parameters(), weight_decay=0.1))


def _train(opt: ScapeOptimizer, net: torch.nn.Module, sched: Any, steps: range) -> None:
    """The given steps through ``opt.step(closure)``, then the schedule, on 8 samples seeded by the step."""
    for step in steps:
        x, y = random_batch(step, 8)
        opt.step(lambda x=x, y=y: torch.nn.functional.mse_loss(net(x), y).backward())
        sched.step()
        opt.zero_grad()


def test_scape_optimizer_steps_saves_and_resumes_exactly_in_one_process() -> None:
    def fresh() -> tuple[torch.nn.Module, ScapeOptimizer, Any]:
        net = make_net()
        adamw = torch.optim.AdamW(param_groups(net, LR), lr=0.02)
        sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda s: 1 / (1 + s))
        return net, engine_setup.build_scape_optimizer(adamw, CFG, net, None), sched

    net, opt, sched = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        warnings.filterwarnings("ignore", message=".*is above 0.001")  # lr=0.02: test_a_converted_lr_above...
        _train(opt, net, sched, range(6))
    assert opt.engine.step_count == 6 and opt.param_groups[0]["lr"] == pytest.approx(0.02 / 7)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())  # zeroed views

    net2, opt2, sched2 = fresh()
    _train(opt2, net2, sched2, range(3))
    state, sched_state = opt2.state_dict(), sched2.state_dict()
    params = [p.detach().clone() for p in net2.parameters()]
    net3, opt3, sched3 = fresh()
    with torch.no_grad():
        for p, q in zip(net3.parameters(), params, strict=True):
            p.copy_(q)
    opt3.load_state_dict(state)
    sched3.load_state_dict(sched_state)
    _train(opt3, net3, sched3, range(3, 6))
    for a, b in zip(net.parameters(), net3.parameters(), strict=True):
        assert torch.equal(a, b)
    # A param group added after set-up joins the engine in a bucket of its own (issue 19: BaseFinetuning).
    extra = torch.nn.Parameter(torch.zeros(2))
    opt3.add_param_group({"params": [extra]})
    assert len(opt3.engine.buckets) == len(opt.engine.buckets) + 1 and extra.grad is not None


def test_a_state_that_does_not_fit_changes_nothing() -> None:
    net = make_net()
    opt = engine_setup.build_scape_optimizer(AdamS(param_groups(net, LR), lr=0.01), CFG, net, None)
    _train(opt, net, torch.optim.lr_scheduler.LambdaLR(opt.adams, lambda s: 1.0), range(4))
    good = opt.state_dict()
    momentum = [bs.momentum.clone() for bs in opt.engine.buckets]
    bad = {**good, "scape": {**good["scape"], "config": {**good["scape"]["config"], "density": 0.5}}}
    with pytest.raises(ValueError, match=r"'density': \(0.5, 0.1\)"):
        opt.load_state_dict(bad)
    buckets = [dict(b) for b in good["scape"]["buckets"]]
    buckets[-1]["residual"] = buckets[-1]["residual"][:-1]
    with pytest.raises(ValueError, match="residual"):
        opt.load_state_dict({**good, "scape": {**good["scape"], "buckets": buckets}})
    with pytest.raises(ValueError, match="not written by a SCAPE strategy"):
        opt.load_state_dict(torch.optim.AdamW(net.parameters()).state_dict())
    assert all(torch.equal(a, bs.momentum) for a, bs in zip(momentum, opt.engine.buckets, strict=True))
    # A state saved by an earlier version holds its options: one that never changed a run is passed over, one saved
    # at a value this version no longer offers is a change of settings.
    old = {**good["scape"]["config"], "collective_timeout_s": 5.0, "seed": 3, "mask_refresh_interval": 1}
    opt.load_state_dict({**good, "scape": {**good["scape"], "config": old}})
    refreshed = {**good["scape"]["config"], "mask_refresh_interval": 4}
    with pytest.raises(ValueError, match=r"'mask_refresh_interval': \(4, 1\).*resume_with_new_config=True"):
        opt.load_state_dict({**good, "scape": {**good["scape"], "config": refreshed}})


# ---------------------------------------------------------------------------------------- checkpoints


def test_rank_files_are_tied_to_their_checkpoint(tmp_path: Any) -> None:
    io = TorchCheckpointIO()
    net = make_net()
    opt = engine_setup.build_scape_optimizer(AdamS(net.parameters(), lr=0.01), CFG, net, None)
    full = opt.state_dict()
    path = str(tmp_path / "model.ckpt")
    stub = checkpoint_protocol.make_stub(full, "id-1")
    io.save_checkpoint({"optimizer": stub}, path)
    checkpoint_protocol.save_rank_states(io, path, 0, 1, {"optimizer": full}, "id-1")
    assert os.path.isfile(tmp_path / "model.ckpt.scape" / "id-1-rank-00000.pt")
    loaded = checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1)
    opt.check_state_dict(loaded["optimizer"])
    with pytest.raises(ValueError, match="written by 1 ranks, but this run has 2"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 2)
    with pytest.raises(ValueError, match="does not belong"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": checkpoint_protocol.make_stub(full, "id-2")}, 0, 1)
    with pytest.raises(FileNotFoundError, match=r"rank 1 is missing.*\.scape"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 1, 1)
    with pytest.raises(ValueError, match="not written by a SCAPE strategy"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": {"state": {}, "param_groups": []}}, 0, 1)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        checkpoint_protocol.load_main_checkpoint(io, path, weights_only=None)
    # A pickled object (a plain DataLoader in the saved state) is not corruption: the error names the class.
    pickled = str(tmp_path / "pickled.ckpt")
    io.save_checkpoint({"loader": torch.utils.data.DataLoader([1, 2])}, pickled)
    with pytest.raises(RuntimeError, match=r"refuses \(torch\.utils\.data\.dataloader\.DataLoader\)"):
        checkpoint_protocol.load_main_checkpoint(io, pickled, weights_only=None)
    checkpoint_protocol.remove_rank_states(io, path, 0, is_global_zero=True)
    assert not os.path.exists(tmp_path / "model.ckpt.scape")
    with pytest.raises(ValueError, match="shape mismatch"):
        checkpoint_protocol.check_module_state(
            make_net(), {**make_net().state_dict(), "0.bias": torch.zeros(3)}, True, "ckpt"
        )
    # The FSDP form compares with the shapes of this rank's shards, not with the module's whole tensors.
    shards = {k: torch.Size([1, *v.shape[1:]]) for k, v in make_net().state_dict().items()}
    local = {k: torch.zeros(shape) for k, shape in shards.items()}
    checkpoint_protocol.check_module_state(make_net(), local, True, "shard", own_shapes=shards)
    with pytest.raises(ValueError, match=r"0\.bias: saved \(\d+,\), model \(1,\)"):
        checkpoint_protocol.check_module_state(make_net(), make_net().state_dict(), True, "shard", own_shapes=shards)


def test_rank_zero_removes_the_rank_directory_when_another_rank_deletes_its_file_during_the_removal(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 deleting its file while rank 0's recursive removal runs stopped that removal midway (as shutil.rmtree
    raises FileNotFoundError), and ModelCheckpoint's old checkpoints left their ``.scape`` directories behind."""
    io = TorchCheckpointIO()
    path = str(tmp_path / "epoch=0.ckpt")
    directory = tmp_path / "epoch=0.ckpt.scape"
    directory.mkdir()
    for rank in range(2):
        (directory / f"id-rank-{rank:05d}.pt").write_bytes(b"x")
    remove = io.remove_checkpoint
    calls: list[str] = []

    def racing_remove(target: Any) -> None:
        calls.append(str(target))
        if str(target) == str(directory) and len([c for c in calls if c == str(directory)]) == 1:
            os.remove(directory / "id-rank-00001.pt")  # rank 1, between the listing and the deletion
            raise FileNotFoundError(str(directory / "id-rank-00001.pt"))
        remove(target)

    monkeypatch.setattr(io, "remove_checkpoint", racing_remove)
    checkpoint_protocol.remove_rank_states(io, path, 0, is_global_zero=True)
    assert not directory.exists()
    assert calls.count(str(directory)) == 2


def test_protocol_writes_rank_files_before_the_main_file_and_checks_before_loading(tmp_path: Any) -> None:
    """The protocol both strategies call, on one rank: the save's order and name, and the checks of a load."""
    io = TorchCheckpointIO()
    net = make_net()
    opt = engine_setup.build_scape_optimizer(AdamS(net.parameters(), lr=0.01), CFG, net, None)
    path = str(tmp_path / "model.ckpt")
    seen: list[str] = []

    def barrier(name: str) -> None:
        seen.append(name)
        assert os.path.isfile(rank_file(path, 0)) and not os.path.exists(path)

    checkpoint_protocol.save_scape_checkpoint(
        io,
        path,
        {"optimizer": opt.state_dict()},
        lambda stubs: {"model": net.state_dict(), **stubs},
        rank=0,
        world_size=1,
        broadcast=lambda save_id: save_id,
        barrier=barrier,
    )
    assert seen == ["scape_save_checkpoint"]
    main = io.load_checkpoint(path)
    assert list(main) == ["model", "optimizer"] and checkpoint_protocol.is_scape_stub(main["optimizer"])

    def plan(checkpoint: dict[str, Any], **kwargs: Any) -> checkpoint_protocol.LoadPlan:
        return checkpoint_protocol.LoadPlan(
            stubs={"optimizer": checkpoint.get("optimizer")},
            optimizers={"optimizer": opt},
            modules={"model": (net, checkpoint["model"], True)},
            **kwargs,
        )

    def read(**kwargs: Any) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        return checkpoint_protocol.read_and_check(
            io, path, lambda c: plan(c, **kwargs), rank=0, world_size=1, weights_only=None
        )

    checkpoint, full = read(name_keys=True)
    assert checkpoint_protocol.is_scape_stub(checkpoint["optimizer"])  # the caller puts the full states in place
    assert list(full) == ["optimizer"] and checkpoint_protocol.is_scape_state(full["optimizer"])
    opt.check_state_dict(full["optimizer"])
    with pytest.raises(KeyError, match="'extra' that does not exist"):
        read(required=("model", "optimizer", "extra"))
    other = make_net()
    other[0] = torch.nn.Linear(other[0].in_features, other[0].out_features + 1)
    with pytest.raises(ValueError, match=r"model.ckpt', 'model' does not fit the model"):
        checkpoint_protocol.read_and_check(
            io,
            path,
            lambda c: checkpoint_protocol.LoadPlan(modules={"model": (other, c["model"], True)}, name_keys=True),
            rank=0,
            world_size=1,
            weights_only=None,
        )


# --------------------------------------------------------------------------------- engine support


def _engine_run(
    rank: int,
    comm: Communicator,
    steps: int,
    check_finite: bool = False,
    scale: float | None = None,
    inject: int | None = None,
    early_norm: bool = False,
    max_norm: float | None = None,
) -> dict[str, Any]:
    """One rank of ``steps`` engine steps on the tiny net; per step: skipped or not, the gradient norm, and
    the parameters with each bucket's state (``inject``: an inf in rank 1's loss at that step)."""
    net = make_net()
    engine = ScapeEngine(
        AdamS(param_groups(net, LR), lr=0.01), CFG, comm, param_order=list(net.parameters()),
        loss_scale=None if scale is None else (lambda: scale), skip_nonfinite=check_finite,
    )  # fmt: skip
    out: dict[str, Any] = {"skipped": [], "norms": [], "states": []}
    for step in range(steps):
        x, y = random_batch(100 * step + rank, 8)
        loss = torch.nn.functional.mse_loss(net(x), y)
        if inject == step and rank == 1:
            loss = loss * float("inf")
        (loss * (scale or 1.0)).backward()
        if early_norm:
            out["norms"].append(engine.global_grad_norm())
        engine.step(max_grad_norm=max_norm)
        if not early_norm:
            out["norms"].append(engine.last_grad_norm)
        engine.zero_grad()
        out["skipped"].append(engine.last_step_skipped)
        s = engine.state_dict()
        out["states"].append(
            (flat(net.parameters()), [(b["momentum"], b["residual"], b["last_sent"], b["masks"]) for b in s["buckets"]])
        )
    engine.close()
    return out


def test_guarded_and_scaled_steps_equal_plain_steps_bitwise() -> None:
    plain = simulate(2, lambda r, c: _engine_run(r, c, 6))
    guarded = simulate(2, lambda r, c: _engine_run(r, c, 6, check_finite=True, scale=1024.0))
    for r in range(2):
        assert same(plain[r]["states"], guarded[r]["states"])


def test_a_non_finite_step_is_skipped_everywhere_and_changes_nothing() -> None:
    out = simulate(2, lambda r, c: _engine_run(r, c, 6, check_finite=True, scale=64.0, inject=3))
    for o in out:
        assert o["skipped"] == [False, False, False, True, False, False]
        assert same(o["states"][2], o["states"][3])
    assert same(out[0]["states"][5][0], out[1]["states"][5][0])
    # Dense warm-up steps are guarded too.
    warm = simulate(2, lambda r, c: _engine_run(r, c, 3, check_finite=True, inject=0))
    assert [o["skipped"] for o in warm] == [[True, False, False]] * 2


def test_early_global_norm_is_the_clipping_norm_and_changes_nothing() -> None:
    late = simulate(2, lambda r, c: _engine_run(r, c, 5, max_norm=0.5))
    early = simulate(2, lambda r, c: _engine_run(r, c, 5, max_norm=0.5, early_norm=True))
    for r in range(2):
        assert early[r]["norms"] == late[r]["norms"]
        assert same(early[r]["states"], late[r]["states"])


# ---------------------------------------------------------------------------- what the user is told


def _stepped_engine(config: ScapeConfig, steps: int) -> ScapeEngine:
    net = make_net()
    engine = ScapeEngine(AdamS(param_groups(net, LR), lr=LR), config, param_order=list(net.parameters()))
    for step in range(steps):
        x, y = random_batch(step, 8)
        torch.nn.functional.mse_loss(net(x), y).backward()
        engine.step()
        engine.zero_grad()
    return engine


def test_a_run_inside_its_dense_warmup_is_told_once_before_or_after_it() -> None:
    default = ScapeConfig(density=0.01)  # 30 dense warm-up steps, then 120 dense steps of the density ramp
    with pytest.warns(UserWarning) as before:
        notice = warmup_notice.WarmupNotice()
        notice.before_run(default, 30.0)  # the Trainer knows the length: the warning comes before the first step
        notice.after_run(_stepped_engine(default, 30))
    (message,) = [str(w.message) for w in before]
    assert [w.category for w in before] == [DenseWarmupWarning]  # what the demo's dense baseline filters
    assert "30 optimizer steps" in message and "dense_warmup_steps=30" in message
    assert "the first 120 of density_ramp_steps=400" in message
    assert "ScapeStrategy(dense_warmup_steps=1, density_ramp_steps=12)" in message

    with pytest.warns(UserWarning) as after:  # Fabric: at the end (teardown, or when the process exits)
        notice = warmup_notice.WarmupNotice()
        notice.before_run(default, None)
        notice.after_run(_stepped_engine(default.replace(dense_warmup_steps=4, density_ramp_steps=0), 4))
        notice.after_run(_stepped_engine(default.replace(dense_warmup_steps=4, density_ramp_steps=0), 4))
    (message,) = [str(w.message) for w in after]
    assert "ended after 4 optimizer steps" in message and "dense_warmup_steps=4" in message

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # longer than the warm-up, no warm-up, length unknown, never stepped
        warmup_notice.WarmupNotice().before_run(default, 161.0)
        warmup_notice.WarmupNotice().before_run(default.replace(dense_warmup_steps=0), 5.0)
        warmup_notice.WarmupNotice().before_run(default, float("inf"))
        warmup_notice.WarmupNotice().after_run(
            _stepped_engine(default.replace(dense_warmup_steps=2, density_ramp_steps=0), 3)
        )
        warmup_notice.WarmupNotice().after_run(_stepped_engine(default, 0))
        # The int8 wire with a warm-up as long as the run is dense by choice (every step AdamS, 1/4 of DDP's bytes).
        int8_dense = default.replace(wire_format="int8", dense_warmup_steps=30)
        warmup_notice.WarmupNotice().before_run(int8_dense, 30.0)
        warmup_notice.WarmupNotice().after_run(_stepped_engine(int8_dense, 30))
    # With the int8 wire, a run that ends in the ramp's dense steps is still told.
    with pytest.warns(DenseWarmupWarning, match="40 optimizer steps"):
        warmup_notice.WarmupNotice().before_run(default.replace(wire_format="int8"), 40.0)


def test_the_engine_line_states_the_warmup_and_the_effective_density() -> None:
    big = torch.nn.Linear(1024, 1024)
    engine = ScapeEngine(AdamS(big.parameters(), lr=LR), ScapeConfig(density=0.01), param_order=list(big.parameters()))
    line = engine_setup.describe_engine(engine)
    assert "1,049,600 parameters in 1 bucket" in line and "first 30 steps dense (dense_warmup_steps)" in line
    assert "1.00% of the coordinates per step (effective density; density=0.01)" in line and "small" not in line
    # The tiny net at the default chunk size would be mostly padding: its buckets get chunks sized to them,
    # and the line says so (its 88 biases get 1 slot: 1.1%).
    tiny = engine_setup.describe_engine(_stepped_engine(ScapeConfig(density=0.01), 0))
    assert "2,968 parameters in 2 buckets" in tiny and "1.01% of the coordinates" in tiny
    assert "This model is small: 2 buckets use chunks smaller than chunk_size=4096" in tiny, tiny
    assert "2,880 parameters in chunks of 2,880, 29 slots each" in tiny
    assert "88 parameters in chunks of 88, 1 slot each" in tiny


def test_where_scape_chooses_the_form_the_engine_line_says_what_it_measures_and_chooses_from() -> None:
    line = engine_setup.describe_engine(_stepped_engine(ScapeConfig(dense_warmup_steps=2), 0))
    assert "the first 5 steps fp32 dense (as DDP + AdamS sends them), measuring the compute and the link" in line
    assert "of fp32 dense, int8 dense, int8 d=0.025, int8 d=0.01, fp32 d=0.01" in line
    assert "set wire_format= and density= to fix the form" in line


def test_an_adams_subclass_without_its_own_step_is_accepted_whatever_torch_wrapped() -> None:
    """torch's Optimizer.__init__ may assign a profiling wrapper of the inherited step to the subclass itself."""
    from lightning_scape.runtime.optimizer import _overrides_step

    class Plain(AdamS):
        pass

    Plain.step = torch.optim.Optimizer.profile_hook_step(AdamS.step)  # what torch does for a first instance
    assert not _overrides_step(Plain)

    class OwnStep(AdamS):
        def step(self, closure: Any = None) -> Any:
            return super().step(closure)

    assert _overrides_step(OwnStep)


def test_a_converted_lr_that_never_changes_is_told_once_after_the_dense_steps_and_ramp() -> None:
    def told(notices: ConvertedLrNotices, lrs: list[list[float]]) -> list[int]:
        steps = []
        for step, group_lrs in enumerate(lrs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                notices.before_step([{"lr": lr} for lr in group_lrs])
            steps += [step for w in caught if "has not changed in" in str(w.message)]
        return steps

    n = CONSTANT_LR_STEPS
    # Constant: told once, at the step after CONSTANT_LR_STEPS unchanged ones, naming the schedule to use.
    assert told(ConvertedLrNotices("AdamW", converted=True), [[1e-3, 1e-4]] * (n + 50)) == [n]
    # A scheduler's warm-up or decay, however late, changes it: nothing to say.
    assert told(ConvertedLrNotices("AdamW", converted=True), [[1e-3]] * (n - 1) + [[9e-4]] * 60) == []
    # A param group added starts the count again (its rate is new).
    assert told(ConvertedLrNotices("Adam", converted=True), [[1e-3]] * 100 + [[1e-3, 1e-3]] * (n + 1)) == [n + 100]
    # The AdamS the user chose is stepped as chosen.
    assert told(ConvertedLrNotices("AdamS", converted=False), [[1e-3]] * (n + 50)) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        told_once = ConvertedLrNotices("AdamW", converted=True)
        for _ in range(n + 1):
            told_once.before_step([{"lr": 1e-3}])
    (message,) = [str(w.message) for w in caught]
    assert "CosineAnnealingLR" in message and "AdamW converted to AdamS" in message


def test_a_converted_optimizer_without_a_scheduler_is_told_before_its_first_step_and_not_again() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices = ConvertedLrNotices("AdamW", converted=True)
        notices.no_scheduler()  # what the Trainer strategies call at set-up when there is no LR scheduler
        for _ in range(CONSTANT_LR_STEPS + 10):
            notices.before_step([{"lr": 1e-3}])
        ConvertedLrNotices("AdamS", converted=False).no_scheduler()  # the AdamS the user chose: nothing
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("lightning_scape: configure_optimizers returned no learning-rate scheduler")
    assert "CosineAnnealingLR" in message and "up to 31%" in message
