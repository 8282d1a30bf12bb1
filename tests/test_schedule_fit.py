"""A run's schedule against its length: the bytes the whole run sends, and the notice of a schedule that does
not fit (the Trainer's and ``pretrain``'s syntax)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import make_net

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.planning.run_traffic import run_bytes
from lightning_scape.runtime import warmup_notice
from lightning_scape.warnings import DenseWarmupWarning


def _counted(cfg: ScapeConfig, steps: int) -> tuple[list[Any], float, int]:
    """Two simulated ranks of ``steps`` steps: the layout, and the bytes rank 0's engine counted (sent, DDP's)."""

    def worker(rank: int, comm: Communicator) -> tuple[list[Any], float, int]:
        model = make_net(0)
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm, sync_params=False)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            engine.step()
            engine.zero_grad()
        engine.close()
        c = engine.counters
        return [bs.layout for bs in engine.buckets], float(c.total_sent_bytes), c.total_dense_equivalent

    return simulate(2, worker)[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sharded": False},
        {"mask_delay": 0},
        {"density_ramp_steps": 0},
        {"wire_format": "int8"},
    ],
)
@pytest.mark.parametrize("steps", [3, 9, 40])
def test_the_run_bytes_are_what_the_engine_counts(options: dict[str, Any], steps: int) -> None:
    cfg = ScapeConfig(
        **{"density": 0.05, "chunk_size": 64, "dense_warmup_steps": 2, "density_ramp_steps": 12, **options}
    )
    layout, sent, ddp = _counted(cfg, steps)
    assert run_bytes(layout, cfg, 2, steps) == (sent, ddp)


def _layout() -> list[Any]:
    big = torch.nn.Linear(256, 256)
    return [
        bs.layout for bs in ScapeEngine(AdamS(big.parameters()), ScapeConfig(density=0.01), sync_params=False).buckets
    ]


def _notice(cfg: ScapeConfig, steps: float, syntax: warmup_notice.Syntax = "python") -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warmup_notice.WarmupNotice().before_run(cfg, steps, _layout(), 2, syntax)
    return [str(w.message) for w in caught if w.category is DenseWarmupWarning]


def test_a_run_that_ends_inside_the_ramp_is_told_the_bytes_and_a_schedule_that_fits() -> None:
    (message,) = _notice(ScapeConfig(density=0.01), 256)
    assert "256 optimizer steps" in message and "ends inside SCAPE's density ramp (step 430)" in message
    assert "ScapeStrategy(dense_warmup_steps=7, density_ramp_steps=102)" in message
    layout = _layout()
    sent, ddp = run_bytes(layout, ScapeConfig(density=0.01), 2, 256)
    fitted, _ = run_bytes(layout, ScapeConfig(density=0.01, dense_warmup_steps=7, density_ramp_steps=102), 2, 256)
    assert f"sends {sent / ddp:.0%} of DDP's bytes" in message and f"sends {fitted / ddp:.0%}:" in message
    assert fitted < sent


def test_a_run_past_its_ramp_that_saves_enough_hears_nothing() -> None:
    assert _notice(ScapeConfig(density=0.01), 20_000) == []  # the defaults fit a long run
    assert (
        _notice(ScapeConfig(density=0.01, dense_warmup_steps=7, density_ramp_steps=102), 256) == []
    )  # the suggested one
    # Past the ramp but above a quarter of DDP's bytes: a schedule the user chose is left alone, the default
    # one (150 dense steps of 500) is questioned.
    assert _notice(ScapeConfig(density=0.01, dense_warmup_steps=30, density_ramp_steps=40), 100) == []
    (message,) = _notice(ScapeConfig(density=0.01), 500)
    assert "ends inside" not in message and "ScapeStrategy(dense_warmup_steps=15, density_ramp_steps=200)" in message
    sent, ddp = run_bytes(_layout(), ScapeConfig(density=0.01), 2, 500)
    assert sent > 0.25 * ddp and f"sends {sent / ddp:.0%} of DDP's bytes" in message


def test_pretrain_is_told_in_its_flags_without_a_source_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert _notice(ScapeConfig(density=0.01), 256, "cli") == []  # not a Python warning: a line of the command
    err = capsys.readouterr().err
    assert err.startswith("lightning-scape pretrain: warning: this run has 256 optimizer steps")
    assert "--scape.dense_warmup_steps 7 --scape.density_ramp_steps 102" in err and ".py:" not in err
    warmup_notice.WarmupNotice().before_run(ScapeConfig(density=0.01), 20, syntax="cli")  # all dense: the same flags
    assert "--scape.dense_warmup_steps 1 --scape.density_ramp_steps 8" in capsys.readouterr().err


def test_a_run_dense_because_its_density_is_above_a_quarter_is_told_so_not_of_a_ramp() -> None:
    # No warm-up, so no ramp: the steps are dense because a step at density 1 is sent dense.
    (message,) = _notice(ScapeConfig(density=1.0, dense_warmup_steps=0), 300)
    assert "300 optimizer steps, all sent dense: density=1 is above 1/4" in message
    assert "density_ramp_steps" not in message and "warm-up" not in message
    assert "ScapeStrategy(density=0.01)" in message
    # A warm-up without dense ramp steps names the warm-up only.
    (message,) = _notice(ScapeConfig(density=0.01, dense_warmup_steps=40, density_ramp_steps=0), 30)
    assert "by SCAPE's warm-up (dense_warmup_steps=40):" in message and "of density_ramp_steps" not in message


def test_one_process_is_not_told_that_its_steps_send_the_whole_gradient() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is sent at all: the strategies' OneProcessWarning says so
        warmup_notice.WarmupNotice().before_run(ScapeConfig(density=0.01), 20, _layout(), world_size=1)
        warmup_notice.WarmupNotice().before_run(ScapeConfig(density=0.01), 20, world_size=1, syntax="cli")
