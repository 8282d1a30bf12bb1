"""SCAPE chooses its form from the link it measures: the prediction, the choice, and the engine's switches.

The measurements are given, not timed: a pilot whose ``_measure`` returns a link set by the test, so every
decision here is the same on any machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest
import torch
from helpers import make_net, random_batch
from torch import Tensor

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator, Wire
from lightning_scape.comm.wire import all_gather_bytes, all_reduce_bytes
from lightning_scape.engine.layout import Bucket
from lightning_scape.planning import forms, pilot, run_summary
from lightning_scape.planning.forms import FP32_DENSE, INT8_DENSE, Form
from lightning_scape.planning.network import Cluster, Link
from lightning_scape.planning.run_traffic import dense_step_bytes
from lightning_scape.planning.traffic import parameter_groups, scape_layout
from lightning_scape.pytorch.monitors import form_metrics

CONFIG = ScapeConfig(chunk_size=64, dense_warmup_steps=4, density_ramp_steps=3)  # SCAPE chooses the form
SLOW, FAST = Link(1e5, 0.0, 1.0), Link(1e13, 0.0, 1.0)


@pytest.mark.parametrize(
    ("world_size", "bps", "expected"),
    [(2, 1e8, "int8 d=0.025"), (2, 1e9, "int8 dense"), (2, 1e10, "fp32 dense"), (4, 1e8, "int8 d=0.025")],
)
def test_on_each_link_of_the_benchmark_it_takes_the_form_that_reached_the_loss_first(
    world_size: int, bps: float, expected: str
) -> None:
    # The time-to-loss benchmark's model (0.86M parameters) and compute (80 ms a step on its 2-core machine):
    # fastest to L* were the int8 wire at d = 0.025 at 100 Mbit/s, every step dense on the int8 wire at 1 Gbit/s and
    # DDP + AdamS at 10 Gbit/s (docs/benchmarks.md).
    layout = scape_layout(parameter_groups(numel=857_000), world_size, CONFIG.start_form())
    link = Link(bps * 0.95, 50e-6, 1.0)
    cluster = Cluster(world_size, 1, link)
    predictions = forms.predict(forms.candidates(True), layout, ScapeConfig(), cluster, {FP32_DENSE: 0.08})
    assert forms.choose(predictions, FP32_DENSE).name == expected


def test_a_form_must_be_clearly_faster_to_replace_the_one_in_use() -> None:
    def at(ms: float, form: Form) -> forms.Prediction:
        return forms.Prediction(form, ms / 1e3, forms.STEPS_TO_LOSS[form], True)

    close = [at(100, FP32_DENSE), at(95, INT8_DENSE)]  # 5% faster: noise, not a reason to switch
    assert forms.choose(close, FP32_DENSE) == FP32_DENSE and forms.choose(close, INT8_DENSE) == INT8_DENSE
    clear = [at(100, FP32_DENSE), at(85, INT8_DENSE)]
    assert forms.choose(clear, FP32_DENSE) == INT8_DENSE
    # Time to the same loss, not per step: 80 ms sparse steps need 1.33x the steps (106 ms of progress).
    assert forms.choose([at(100, FP32_DENSE), at(80, Form("int8", 0.025))], FP32_DENSE) == FP32_DENSE


def test_the_link_is_read_from_two_timed_gathers() -> None:
    # W = 2: 1000 and 101,000 fp32 elements per rank send 4 kB and 404 kB; 400 kB more in 32 ms more is 100 Mbit/s,
    # and the small one's 1 ms less its 0.32 ms of bytes is the latency (one ring step).
    link = forms.link_from_probe(1000, 1e-3, 101_000, 33e-3, 2)
    assert link.bandwidth_bps == pytest.approx(1e8) and link.latency_s == pytest.approx(0.68e-3)
    assert forms.link_from_probe(1000, 2e-3, 101_000, 1e-3, 2).bandwidth_bps == 1e13  # noise: the fastest link


class GivenLink(pilot.FormPilot):
    """A pilot that sends its probes but reads their times from ``links`` (one per decision), and 1 ms of compute,
    instead of timing them."""

    def __init__(self, links: list[Link], int8_dense_s: float | None = None) -> None:
        super().__init__(on_decision=lambda decision: None)
        self.links = links
        if int8_dense_s is not None:  # as if every step dense on the int8 wire had been measured that slow
            self.compute_s[INT8_DENSE] = int8_dense_s

    def _compute(self, samples: list[float]) -> float:
        return 1e-3

    def _step_time(self, samples: list[float]) -> float | None:
        return None  # predicted from the given link, as the other forms

    def _recent_step(self, engine: ScapeEngine) -> float | None:
        return None  # no watch on the wall-clock: the decisions here come from the given links only

    def _probe_times(self, engine: ScapeEngine) -> tuple[float, int, float]:
        sizes = (pilot.PROBE_SMALL_NUMEL, pilot.PROBE_LARGE_NUMEL)
        for n in sizes:  # sent, not timed
            pilot.timed_gather(engine, n)
        link = self.links[min(len(self.decisions), len(self.links) - 1)]
        small, large = (8 * all_gather_bytes(n, 4, engine.world_size) / link.bandwidth_bps for n in sizes)
        return small, pilot.PROBE_LARGE_NUMEL, large


@pytest.mark.parametrize(("bps", "numel"), [(1e8, 1 << 18), (1e9, 1 << 20), (1e10, 1 << 24), (1e12, 1 << 24)])
def test_on_a_fast_link_the_large_probe_grows_until_its_time_is_measurable(
    monkeypatch: pytest.MonkeyPatch, bps: float, numel: int
) -> None:
    # 1 MB per rank takes 84 ms at 100 Mbit/s but 0.8 ms at 10 Gbit/s, where a millisecond of noise would halve the
    # link: the probe grows 4x at a time until it takes 20 ms, its gathered output at most 2^25 elements.
    def timed(engine: ScapeEngine, n: int) -> float:
        return 8 * all_gather_bytes(n, 4, engine.world_size) / bps

    monkeypatch.setattr(pilot, "timed_gather", timed)

    def probe(rank: int, comm: Communicator) -> tuple[float, int, float]:
        engine = ScapeEngine(AdamS(make_net(0, torch.float64).parameters()), CONFIG, comm)
        return pilot.FormPilot()._probe_times(engine)

    for small, n, large in simulate(2, probe):
        assert n == numel
        link = forms.link_from_probe(pilot.PROBE_SMALL_NUMEL, small, n, large, 2)
        assert link.bandwidth_bps == pytest.approx(bps)


def _train(engine: ScapeEngine, model: torch.nn.Module, rank: int, steps: range) -> None:
    """Take ``steps`` of the tiny net; each step's batch is fixed by its number and the rank."""
    for step in steps:
        x, y = random_batch(100 * step + rank, 8, torch.float64)
        torch.nn.functional.mse_loss(model(x), y).backward()
        engine.step()
        engine.zero_grad()


def _decisions(rank: int, comm: Communicator, form_pilot: GivenLink, steps: int) -> list[pilot.Decision]:
    """``form_pilot``'s decisions over ``steps`` steps of the tiny net from the start."""
    model = make_net(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters()), CONFIG, comm, form_pilot=form_pilot)
    _train(engine, model, rank, range(steps))
    engine.close()
    return form_pilot.decisions


def _resumed(rank: int, comm: Communicator, first: dict[str, Any], links: list[Link]) -> tuple[ScapeEngine, Any]:
    """A new engine and model resumed from ``_run``'s result ``first``: its weights and its SCAPE state."""
    model = make_net(0, torch.float64)
    with torch.no_grad():
        for p, q in zip(model.parameters(), first["params"], strict=True):
            p.copy_(q)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), CONFIG, comm, sync_params=False,
                         form_pilot=GivenLink(links))  # fmt: skip
    engine.load_state_dict(first["state"])
    return engine, model


def _run(
    rank: int,
    comm: Communicator,
    links: list[Link],
    steps: int,
    int8_dense_s: float | None = None,
    fold: bool = False,
    config: ScapeConfig = CONFIG,
) -> Any:
    """``steps`` steps of the tiny net under a pilot that reads ``links``; with ``fold``, at the first fp32 dense step
    after sparse ones, this rank's residual plus gradient and the norm of the step's averaged gradient."""
    model = make_net(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), config, comm, form_pilot=GivenLink(links, int8_dense_s))
    folded: dict[str, Any] = {}
    for step in range(steps):
        x, y = random_batch(100 * step + rank, 8, torch.float64)
        live = any(bs.residual_live for bs in engine.buckets)
        watch = fold and not folded and engine.in_warmup and engine.config.wire_format == "full" and live
        residual = torch.cat([bs.residual.clone() for bs in engine.buckets])  # before the backward's launches
        torch.nn.functional.mse_loss(model(x), y).backward()
        if watch:
            folded["grad"] = torch.cat([bs.grads.clone() for bs in engine.buckets])
            folded["owed"] = residual + folded["grad"]
            folded["norm"] = engine.global_grad_norm()
        engine.step()
        engine.zero_grad()
    engine.close()
    assert isinstance(engine.pilot, GivenLink)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "chosen": [(d.step, d.chosen.name) for d in engine.pilot.decisions],
        "measured": [d.compute_s is not None for d in engine.pilot.decisions],
        "compute_of": sorted(f.name for f in engine.pilot.compute_s),
        "residual": [bs.residual.clone() for bs in engine.buckets],
        "probe_bytes": engine.counters.total_sent["probe"],
        "folded": folded,
        "metrics": form_metrics(engine),
        "state": engine.state_dict(),
        "ddp_form": [bs.dense_replica for bs in engine.buckets],
        "momentum": [bs.momentum.clone() for bs in engine.buckets],
    }


def test_it_goes_sparse_on_a_slow_link_and_dense_again_when_the_link_is_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    ranks = simulate(2, lambda rank, comm: _run(rank, comm, [SLOW, SLOW, FAST], 30))
    # After the warm-up (step 4) the slow link makes sparse steps on the int8 wire the fastest; after the ramp and
    # RECHECK_STEPS, still slow: kept; then fast: every step dense.
    chosen = ranks[0]["chosen"]
    assert chosen[0][1].startswith("int8 d=") and chosen[1][1] == chosen[0][1] and chosen[2][1].endswith("dense")
    assert [s for s, _ in chosen[:3]] == [5, 11, 17]  # at least 5 measured steps, then every RECHECK_STEPS
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)  # every rank decided alike: the replicas stay identical
    metrics = ranks[0]["metrics"]  # CommunicationMonitor's view of the last decision: dense, at the fast link
    assert metrics["comm/form_density"] == 1.0 and metrics["comm/link_gbps"] == pytest.approx(1e4)
    # Each decision: 2 timed gathers of each probe size, and one all-reduce of the six measurements (fp64).
    one = pilot.PROBE_REPEATS * (
        all_gather_bytes(pilot.PROBE_SMALL_NUMEL, 4, 2) + all_gather_bytes(pilot.PROBE_LARGE_NUMEL, 4, 2)
    )
    assert ranks[0]["probe_bytes"] == len(chosen) * (one + all_reduce_bytes(6, 8, 2))


def test_turning_dense_after_sparse_steps_sends_the_residual_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    ranks = simulate(2, lambda rank, comm: _run(rank, comm, [SLOW, SLOW, FAST], 18, int8_dense_s=5e-3, fold=True))
    assert ranks[0]["chosen"][2] == (17, "fp32 dense")
    # The fp32 dense step after the sparse ones averaged every rank's residual with its gradient, and left the
    # residuals empty: what the sparse steps had not sent was sent, not dropped.
    owed = sum(r["folded"]["owed"] for r in ranks) / 2
    grads = sum(r["folded"]["grad"] for r in ranks) / 2
    for r in ranks:
        assert r["folded"]["norm"] == pytest.approx(float(owed.norm()), rel=1e-6)
    assert float(grads.norm()) != pytest.approx(float(owed.norm()), rel=1e-3)  # the residual was not empty
    assert all(not r.any() for rank in ranks for r in rank["residual"])
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert all(all(r["ddp_form"]) for r in ranks)  # once the residual went out, the dense steps are DDP's again


def test_a_link_that_speeds_up_during_the_density_ramp_is_seen_at_the_next_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    config = CONFIG.replace(density_ramp_steps=40)  # the sparse form's ramp runs from step 5 to step 45
    ranks = simulate(2, lambda rank, comm: _run(rank, comm, [SLOW, FAST], 14, 5e-3, fold=True, config=config))
    chosen = ranks[0]["chosen"]
    assert chosen[0][1].startswith("int8 d=") and chosen[1] == (11, "fp32 dense")
    # The ramp's steps (dense ones among them) are not the sparse form's: its compute was not taken from them.
    assert ranks[0]["measured"] == [True, False] and chosen[0][1] not in ranks[0]["compute_of"]
    # The switch in the middle of the ramp loses nothing: the next fp32 dense step sent every residual.
    owed = sum(r["folded"]["owed"] for r in ranks) / 2
    assert all(r["folded"]["norm"] == pytest.approx(float(owed.norm()), rel=1e-6) for r in ranks)
    assert all(not r.any() for rank in ranks for r in rank["residual"])
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_a_sparse_form_chosen_after_dense_steps_skips_the_ramps_dense_steps() -> None:
    base = ScapeConfig()  # 30 warm-up steps; at d = 0.025 the 400-step ramp's first 150 are dense
    fixed = ScapeConfig(wire_format="int8", density=0.025)
    assert fixed.dense_steps == 180
    form = Form("int8", 0.025)
    # After 200 dense steps beyond the warm-up, the next step is the ramp's first sparse one, as a fixed form's 181st.
    later = form.config(base, 230, dense_since=30)
    assert later.dense_steps == 230 and later.ramp_density(231) == fixed.ramp_density(181)
    assert later.dense_warmup_steps + later.density_ramp_steps == 230 + 250  # the ramp's sparse 250 steps
    # The whole ramp: at the first decision (no dense steps beyond the warm-up), after sparse steps, and after a
    # dense stretch shorter than the ramp's dense steps.
    assert form.config(base, 30, dense_since=30).dense_warmup_steps == 30
    assert form.config(base, 230).dense_warmup_steps == 230
    assert form.config(base, 230, dense_since=100).dense_warmup_steps == 230


def test_a_link_that_slows_after_dense_steps_turns_them_sparse_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    config = CONFIG.replace(density_ramp_steps=20)  # at d = 0.01 the ramp's first 6 steps are dense

    ranks = simulate(2, lambda rank, comm: _run(rank, comm, [FAST, SLOW], 11, config=config))
    assert [c for _, c in ranks[0]["chosen"]] == ["fp32 dense", "int8 d=0.01"]
    for r in ranks:  # the next step is past the ramp's dense steps
        assert ScapeConfig(**r["state"]["form"]).dense_steps == r["state"]["step_count"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_the_form_in_use_is_judged_by_its_measured_step() -> None:
    class MeasuredSlow(GivenLink):
        def _step_time(self, samples: list[float]) -> float | None:
            return 0.5  # the fp32 dense steps took 500 ms, where the model predicts about 1 ms on this link

    # The first decision: after 5 measured steps.
    decision = simulate(2, lambda rank, comm: _decisions(rank, comm, MeasuredSlow([FAST]), 5))[0][0]
    measured = next(p for p in decision.predictions if p.form == FP32_DENSE)
    assert measured.step_measured and measured.step_s == 0.5
    assert decision.chosen == INT8_DENSE and "fp32 dense 500.0 ms x 1 steps = 500.0 (measured)" in decision.describe()


def test_a_sparse_form_in_use_is_judged_by_the_model_as_its_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its measured step carries work the alternatives' predictions lack (selection, rounding): judged by it, a sparse
    # form would leave for one not run yet, and start that one's ramp again.
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)

    class MeasuredSlow(GivenLink):
        def _step_time(self, samples: list[float]) -> float | None:
            return 0.5

    first, second = simulate(2, lambda rank, comm: _decisions(rank, comm, MeasuredSlow([SLOW]), 11))[0]
    assert not first.chosen.dense and second.chosen == first.chosen
    assert not any(p.step_measured for p in second.predictions)


def test_a_step_that_slows_between_checks_brings_the_next_decision_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 1000)
    monkeypatch.setattr(pilot, "WATCH_STEPS", 5)

    class Watched(GivenLink):
        def _recent_step(self, engine: ScapeEngine) -> float | None:
            return 0.1 if engine.step_count <= 15 else 0.3  # the link falls after step 15: steps take 3x as long

    # Watches after steps 10 (the reference), 15 (the same) and 20 (3x: decide now, not after step 1005).
    decisions = simulate(2, lambda rank, comm: _decisions(rank, comm, Watched([FAST, SLOW]), 24))[0]
    chosen = [(d.step, d.chosen.name) for d in decisions]
    assert [step for step, _ in chosen] == [5, 20] and chosen[1][1].startswith("int8 d=")


def test_a_link_that_falls_just_after_a_check_is_seen_at_the_next_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 10)
    monkeypatch.setattr(pilot, "WATCH_STEPS", 5)

    class FallsAfterACheck(GivenLink):
        def _recent_step(self, engine: ScapeEngine) -> float | None:
            return 0.1 if engine.step_count <= 16 else 0.3  # the link falls just after the check at step 15

    # Checks after steps 5 and 15 (both on the fast link, the form kept); the watch after step 20 compares with the
    # steps before the check at 15, so the fall is decided on at 20, not at the next check after step 25.
    decisions = simulate(2, lambda rank, comm: _decisions(rank, comm, FallsAfterACheck([FAST, FAST, SLOW]), 24))[0]
    assert [(d.step, d.chosen == d.before) for d in decisions] == [(5, True), (15, True), (20, False)]


def _fixed_fp32_dense(rank: int, comm: Communicator, steps: int, forever: bool = False) -> list[Tensor]:
    """The reference: the same steps in the sharded form that sends them dense in fp32 (a warm-up longer than the
    run); with ``forever``, the fixed form whose every step is dense, which takes them as DDP's."""
    model = make_net(0, torch.float64)
    config = ScapeConfig(chunk_size=64, wire_format="full", dense_warmup_steps=10**9 if forever else 10**8)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), config, comm)
    assert all(bs.dense_replica == forever for bs in engine.buckets)
    _train(engine, model, rank, range(steps))
    engine.close()
    return [p.detach().clone() for p in model.parameters()]


def test_on_a_fast_link_its_dense_steps_are_ddps_and_checkpoints_keep_the_shards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    gathers: list[str] = []
    all_gather = Wire.all_gather

    def counted(self: Wire, kind: Any, output: Tensor, input: Tensor) -> Any:
        gathers.append(kind)
        return all_gather(self, kind, output, input)

    monkeypatch.setattr(Wire, "all_gather", counted)
    ranks = simulate(2, lambda rank, comm: _run(rank, comm, [FAST], 12))
    assert [name for _, name in ranks[0]["chosen"]] == ["fp32 dense", "fp32 dense"]
    # Every rank holds the whole momentum, the same, and no dense step gathered parameters: each all-reduced its
    # gradient and updated every coordinate, as DDP + AdamS does.
    assert all(all(r["ddp_form"]) for r in ranks) and "dense" not in gathers
    saved = [bucket["momentum"] for bucket in ranks[0]["state"]["buckets"]]
    for a, b, shard in zip(ranks[0]["momentum"], ranks[1]["momentum"], saved, strict=True):
        assert a.numel() == 2 * shard.numel() and torch.equal(a, b)
    # The same steps as the sharded dense form's (W = 2, float64: bitwise).
    reference = simulate(2, lambda rank, comm: _fixed_fp32_dense(rank, comm, 12))
    fixed = simulate(2, lambda rank, comm: _fixed_fp32_dense(rank, comm, 12, forever=True))
    for r in range(2):
        for a, b, c in zip(ranks[r]["params"], reference[r], fixed[r], strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
    # A checkpoint holds each rank's shard, as a sharded engine's does, and resumes bitwise.
    for r in range(2):
        for bucket, whole in zip(ranks[r]["state"]["buckets"], ranks[r]["momentum"], strict=True):
            n = bucket["momentum"].numel()
            assert torch.equal(bucket["momentum"], whole[r * n : (r + 1) * n])

    def resumed(rank: int, comm: Communicator) -> list[Tensor]:
        engine, model = _resumed(rank, comm, _run(rank, comm, [FAST], 8), [FAST])
        _train(engine, model, rank, range(8, 12))
        assert all(bs.dense_replica for bs in engine.buckets)
        engine.close()
        return [p.detach().clone() for p in model.parameters()]

    again = simulate(2, resumed)
    for r in range(2):
        for a, b in zip(ranks[r]["params"], again[r], strict=True):
            assert torch.equal(a, b)


def test_a_checkpoint_resumes_the_chosen_form_and_continues_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    whole = simulate(2, lambda rank, comm: _run(rank, comm, [SLOW], 14))

    def resumed(rank: int, comm: Communicator) -> dict[str, Any]:
        engine, model = _resumed(rank, comm, _run(rank, comm, [SLOW], 9), [SLOW])
        assert engine.config.wire_format == "int8" and not engine.in_warmup
        assert isinstance(engine.pilot, GivenLink) and engine.pilot.switches == [(5, Form("int8", 0.01))]
        summary = run_summary.describe_steps(engine)  # the switches come with the checkpoint
        assert summary.startswith("9, in the forms SCAPE chose: fp32 dense 1-5; int8 d=0.01 6-9")
        _train(engine, model, rank, range(9, 14))
        engine.close()
        return {"params": [p.detach().clone() for p in model.parameters()]}

    again = simulate(2, resumed)
    for r in range(2):
        for a, b in zip(whole[r]["params"], again[r]["params"], strict=True):
            assert torch.equal(a, b)


def test_a_fixed_form_resumes_whether_its_wire_format_is_spelled_out_or_not() -> None:
    from lightning_scape.engine.state import check_config

    saved = ScapeConfig(density=0.05, wire_format="full").to_dict()  # as a state saved before forms were chosen
    check_config(ScapeConfig(density=0.05), saved)
    check_config(ScapeConfig(wire_format="full"), ScapeConfig(density=0.01).to_dict())
    # The former defaults (fp32, d = 0.01) are a fixed form: the new defaults, which choose, are another one.
    with pytest.raises(ValueError, match=r"density.*wire_format"):
        check_config(ScapeConfig(), ScapeConfig(density=0.01, wire_format="full").to_dict())


def test_a_switch_between_sparse_forms_continues_the_density_where_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    config = CONFIG.replace(density_ramp_steps=10)  # at d = 0.025 the ramp's steps 6-8 are dense, 9-15 sparse
    links = [Link(1e7, 0.0, 1.0), Link(1e6, 0.0, 1.0)]  # int8 d=0.025 at step 5, then int8 d=0.01 at step 11
    before, later = (simulate(2, partial(_run, links=links, steps=n, config=config)) for n in (10, 16))
    assert [c for _, c in later[0]["chosen"]] == ["int8 d=0.025", "int8 d=0.01"]
    old, new = ScapeConfig(**before[0]["state"]["form"]), ScapeConfig(**later[0]["state"]["form"])
    # The new ramp starts where its own geometric ramp reaches the old one's density (0.025 ** 0.6 = 0.109 at step
    # 11: 0.01 ** (5 / 10)), so step 12 sends 0.01 ** 0.6 = 0.063, below the old schedule's 0.076, not dense again.
    assert old.density == 0.025 and new.density == 0.01 and new.dense_warmup_steps == 6
    assert new.ramp_density(12) == pytest.approx(0.01**0.6) and new.ramp_density(12) < old.ramp_density(12)
    for a, b in zip(before, later, strict=True):  # no dense step in steps 11-16, on either rank
        assert a["state"]["counters"]["total_sent"]["dense"] == b["state"]["counters"]["total_sent"]["dense"]
    for a, b in zip(later[0]["params"], later[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_a_sparse_form_that_follows_a_denser_schedule_keeps_its_timing() -> None:
    before = ScapeConfig(wire_format="int8", density=0.01, dense_warmup_steps=30)  # at step 230: 0.01 ** 0.5 = 0.1
    after = Form("int8", 0.025).config(ScapeConfig(), 230, sparse_before=before)
    # 0.025's ramp never reaches 0.1 as late: it takes the former ramp's timing, at its own density.
    assert after.dense_warmup_steps == 30 and after.ramp_density(231) == pytest.approx(0.025 ** (201 / 400))
    done = ScapeConfig(wire_format="int8", density=0.01, dense_warmup_steps=30)  # at step 1000 the ramp is over
    assert Form("int8", 0.025).config(ScapeConfig(), 1000, sparse_before=done).ramp_density(1001) == 0.025


def test_it_decides_at_step_10_and_a_longer_warm_up_goes_on_dense_on_the_chosen_wire() -> None:
    config = CONFIG.replace(dense_warmup_steps=20, density_ramp_steps=10)
    links = [Link(1e6, 0.0, 1.0)]  # slow: sparse steps on the int8 wire
    at_10, at_14 = (simulate(2, partial(_run, links=links, steps=n, config=config)) for n in (10, 14))
    assert at_14[0]["chosen"] == [(10, "int8 d=0.01")]
    form = ScapeConfig(**at_14[0]["state"]["form"])
    assert form.wire_format == "int8" and form.dense_warmup_steps == 20  # then the ramp, as a fixed form's

    # Steps 1-10 dense in the parameters' dtype (float64 here) as DDP's all-reduce, 11-14 dense on the int8 wire.
    def sent(run: list[dict[str, Any]]) -> int:
        return sum(v for k, v in run[0]["state"]["counters"]["total_sent"].items() if k in ("dense", "params"))

    ((group, numel, padded),) = at_14[0]["state"]["layout"]
    bucket = Bucket(group, 0, torch.float64, torch.device("cpu"), numel=numel, padded_numel=padded, world_size=2,
                    chunk_size=config.chunk_size)  # fmt: skip
    assert sent(at_10) == 10 * all_reduce_bytes(padded, 8, 2)
    int8_step = dense_step_bytes([bucket], form, 2)
    assert sent(at_14) - sent(at_10) == 4 * int8_step and int8_step < all_reduce_bytes(padded, 8, 2) / 7


def test_the_form_in_use_is_judged_by_its_last_steps() -> None:
    # A link that fell 20 steps before a check: the dense form in use is judged by the steps it slowed (300 ms), not
    # by the median of the 200 since the last check (100 ms), which would keep a form the link no longer carries.
    steps = [0.1] * (pilot.RECHECK_STEPS - pilot.WATCH_STEPS) + [0.3] * pilot.WATCH_STEPS
    assert pilot.FormPilot()._step_time(steps) == 0.3
    # The first decision's few steps: all but the settling ones.
    assert pilot.FormPilot()._step_time([5.0, 4.0, 0.1, 0.2, 0.3]) == 0.2


class _ShardMean:
    """The mean over simulated shards of one replica rank, across their threads: what
    ``fsdp_binding.shard_mean``'s all-reduce over a group's shard group returns to the form pilot."""

    def __init__(self, shards: int) -> None:
        self.barrier = threading.Barrier(shards, timeout=60)
        self.slots: dict[int, Tensor] = {}

    def of(self, shard: int) -> Callable[[Tensor], Tensor]:
        def mean(values: Tensor) -> Tensor:
            self.slots[shard] = values.clone()
            self.barrier.wait()
            total = sum((self.slots[s] for s in sorted(self.slots)), torch.zeros_like(values))
            self.barrier.wait()  # every shard has read the slots before any writes its next values
            return total / len(self.slots)

        return mean


def _shard_decisions(links: list[Link], agree: bool) -> list[list[tuple[int, str]]]:
    """The decisions of each rank of 2 shards x 2 replicas (the FSDP form's engines: one per shard, over its
    replicas), each shard's probes reading its own link; with ``agree``, through the pilot's mean over the shards."""
    means = [_ShardMean(len(links)) for _ in range(2)]  # one per replica rank

    def shard(index: int) -> list[list[tuple[int, str]]]:
        def rank(r: int, comm: Communicator) -> list[tuple[int, str]]:
            form_pilot = GivenLink([links[index]])
            form_pilot.agree = means[r].of(index) if agree else None
            return [(d.step, d.chosen.name) for d in _decisions(r, comm, form_pilot, 16)]

        return simulate(2, rank)

    with ThreadPoolExecutor(len(links)) as pool:
        return [d for ranks in pool.map(shard, range(len(links))) for d in ranks]


def test_the_engines_of_all_shards_take_the_same_form_at_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # ScapeFSDPStrategy runs one engine per shard over its own ranks; one whose link read slow and one whose link read
    # fast would take different forms, and the step waits for the slowest shard. Through `agree` every measurement
    # is the shards' mean: one decision for all.
    monkeypatch.setattr(pilot, "RECHECK_STEPS", 6)
    alone = _shard_decisions([SLOW, FAST], agree=False)
    assert alone[0] == alone[1] and alone[2] == alone[3] and alone[0] != alone[2]  # each shard for itself
    agreed = _shard_decisions([SLOW, FAST], agree=True)
    assert all(d == agreed[0] for d in agreed) and agreed[0][0][1].startswith("int8 d=")
    assert [s for s, _ in agreed[0]] == [5, 11]
