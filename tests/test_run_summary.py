"""The end-of-run summary (``runtime/run_summary.py``): its phases are the engine's own, its bytes the engine's counts,
and a strategy says it once. (The strategies' summaries at the end of real runs: ``test_strategy_trainer`` and
``test_strategy_fabric``.)"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from helpers import make_net, rank_zero_messages

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.planning import run_summary
from lightning_scape.runtime.options import RunSettings
from lightning_scape.runtime.parameter_holding import ReplicatedParameters
from lightning_scape.runtime.scape_runtime import ScapeRuntime


def _run(config: ScapeConfig, steps: int, world_size: int = 2) -> tuple[ScapeEngine, list[dict[str, Any]]]:
    """Rank 0's engine after ``steps`` steps of random gradients, and per step what it sent: dense, or the slots
    per chunk of its mask."""

    def worker(rank: int, comm: Communicator) -> tuple[ScapeEngine, list[dict[str, Any]]]:
        model = make_net(0)
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), config, comm, sync_params=False)
        gen = torch.Generator().manual_seed(rank)
        record = []
        for _ in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            engine.step()
            dense = engine.counters.step_sent["dense"] > 0 or engine.last_used_masks is None
            record.append({"dense": dense, "slots": None if dense else engine.last_used_masks[0].shape[1]})
            engine.zero_grad()
        engine.close()
        return engine, record

    return simulate(world_size, worker)[0]


CONFIGS = {
    "warm-up and ramp": ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=3, density_ramp_steps=10),
    "no ramp": ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=3, density_ramp_steps=0),
    "no warm-up": ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0),
    "density 1, no warm-up": ScapeConfig(density=1.0, chunk_size=64, dense_warmup_steps=0, density_ramp_steps=5),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_phases_are_the_steps_the_engine_took(name: str) -> None:
    config = CONFIGS[name]
    engine, record = _run(config, 16)
    # (The ramps here are short enough that no ramp step rounds to the final slots per chunk.)
    final_slots = config.slots_for(engine.buckets[0].layout.chunk_size)
    for steps in (1, 3, 4, 9, 16):
        taken = record[:steps]
        p = run_summary.phases(config, steps)
        assert p.dense == sum(r["dense"] for r in taken)
        assert p.warmup == min(steps, config.dense_warmup_steps)
        assert p.at_density == sum(r["slots"] == final_slots for r in taken)
        assert p.sparse_ramp == sum(not r["dense"] and r["slots"] != final_slots for r in taken)


def test_the_phases_in_words() -> None:
    default = ScapeConfig(
        density=0.01
    )  # 30 dense warm-up steps, a 400-step ramp whose first 120 are dense and last at density
    assert run_summary.describe_phases(default, 500) == (
        "500: 30 dense warm-up (dense_warmup_steps=30), 120 dense on the density ramp (denser than 1/4), "
        "279 sparse on the density ramp, 71 sparse at density 0.01"
    )
    assert run_summary.describe_phases(default, 20) == "20: 20 dense warm-up (dense_warmup_steps=30)"
    # Without a warm-up there is no ramp: steps at density 1 are dense because the density is above 1/4.
    text = run_summary.describe_phases(ScapeConfig(density=1.0, dense_warmup_steps=0), 300)
    assert text == "300: 300 dense (density=1 is above 1/4, so they are sent dense)"


def test_the_summary_states_the_bytes_and_the_waiting_the_engine_counted() -> None:
    engine, _ = _run(CONFIGS["warm-up and ramp"], 16)
    c = engine.counters
    text = run_summary.summary_text([engine])
    kb = run_summary.format_bytes
    sent, ddp = c.total_sent_bytes, c.total_dense_equivalent
    assert text.startswith(run_summary.HEADING)
    assert f"{kb(sent)} sent per process; DDP would have sent {kb(ddp)}: {kb(ddp - sent)} saved" in text
    # The last step was sparse: its own bytes against DDP's.
    last = f"{kb(c.step_sent_bytes)} in the last step, {c.step_dense_equivalent / c.step_sent_bytes:.1f}x fewer)"
    assert last in text
    waited = f"{c.total_wait_s:.2f} s blocked on SCAPE's collectives ({1e3 * c.total_wait_s / 16:.1f} ms per step)"
    assert waited in text
    assert "16: 3 dense warm-up (dense_warmup_steps=3)" in text
    # One process sends nothing: said so, instead of ratios of zeros.
    solo, _ = _run(CONFIGS["no ramp"], 4, world_size=1)
    assert "communication: none: one replica" in run_summary.summary_text([solo])


def _runtime(engines: list[ScapeEngine]) -> ScapeRuntime:
    """A strategy's runtime whose SCAPE optimizers hold ``engines`` (what the summary reads of them)."""
    holding = ReplicatedParameters(types.SimpleNamespace(world_size=2))
    runtime = ScapeRuntime("ScapeStrategy", ScapeConfig(), RunSettings.of(None, False), holding)
    runtime._optimizers += [types.SimpleNamespace(engine=engine) for engine in engines]  # type: ignore[misc]
    return runtime


def test_a_strategy_sums_a_run_up_once_and_only_a_run_that_stepped() -> None:
    engine, _ = _run(CONFIGS["no ramp"], 4)
    idle = ScapeEngine(AdamS(make_net(0).parameters(), lr=1e-3), ScapeConfig(), sync_params=False)
    strategy = _runtime([idle])
    with rank_zero_messages() as logged:
        strategy.log_run_summary()  # set up, never stepped: nothing to sum up
        strategy._optimizers.append(types.SimpleNamespace(engine=engine))  # type: ignore[arg-type]
        strategy.log_run_summary()
        strategy.log_run_summary()  # teardown and the exit hook both call it
    assert logged == [run_summary.summary_text([engine])]
    assert strategy.run_summary() == run_summary.summary_text([idle, engine])
    off = _runtime([engine])
    off.log_summary = False  # lightning-scape pretrain prints the lines in its own summary
    with rank_zero_messages() as logged:
        off.log_run_summary()
    assert logged == []
    assert "HSDP would have sent" in run_summary.summary_text([engine], baseline="HSDP")
    idle.close()
