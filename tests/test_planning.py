"""``lightning-scape estimate``: bytes against the engine's own counters and hand-worked cases, the step model by
hand, the break-even rate, memory, and the command line's errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator, all_reduce_bytes
from lightning_scape.planning import (
    DDP,
    DDP_BF16,
    SCAPE_INT8_DENSE,
    Cluster,
    Collective,
    Estimate,
    Link,
    ScapeTraffic,
    StepCompute,
    StepTime,
    StepTraffic,
    ddp_bucket_numels,
    ddp_traffic,
    estimate,
    format_estimate,
    forms,
    parameter_groups,
    scape_layout,
    scape_memory,
    step_time,
)
from lightning_scape.planning.estimate import scape_name
from lightning_scape.planning.predict import schedule_cost
from lightning_scape_cli import estimate_command, link_rate, main, parameter_count

MB_PER_S = Link(8e6, efficiency=1.0)  # 1 MB/s: seconds are megabytes


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 300), nn.ReLU(), nn.Linear(300, 64), nn.LayerNorm(64))


def _groups(model: nn.Module) -> list[dict[str, object]]:
    """Two param groups (matrices, vectors): two buckets, as the benchmarks' models have."""
    return [
        {"params": [p for p in model.parameters() if p.dim() > 1]},
        {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0},
    ]


# ------------------------------------------------------------------------------------------------ bytes

BASE = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=3, density_ramp_steps=6)
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "mask_delay=0": {"mask_delay": 0},
    "replicated": {"sharded": False},
    "no warm-up": {"dense_warmup_steps": 0},
    "no warm-up, mask_delay=0": {"dense_warmup_steps": 0, "mask_delay": 0},
    "int8 wire": {"wire_format": "int8"},
    "int8 wire, mask_delay=0": {"wire_format": "int8", "mask_delay": 0},
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_predicted_bytes_equal_the_engines_counters_at_every_step(variant: str, world_size: int) -> None:
    """Warm-up, ramp and sparse steps: what the plan says each step sends is what the engine counts."""
    cfg = BASE.replace(**VARIANTS[variant])
    steps = 14

    def worker(rank: int, comm: Communicator) -> list[dict[Any, int]]:
        model = _net()
        engine = ScapeEngine(AdamS(_groups(model), lr=1e-3), cfg, comm, param_order=list(model.parameters()))
        gen = torch.Generator().manual_seed(rank)
        sent = []
        for _ in range(steps):
            model(torch.randn(8, 24, generator=gen)).square().mean().backward()
            engine.step(max_grad_norm=1.0)
            engine.zero_grad()
            sent.append({k: v for k, v in engine.counters.step_sent.items() if v})
        return sent

    counted = simulate(world_size, worker)[0]
    layout = scape_layout(_groups(_net()), world_size, cfg)
    planned = [{k: v for k, v in s.by_traffic(world_size).items() if v} for s in ScapeTraffic(layout, cfg).steps(steps)]
    assert planned == counted
    assert any("values" in s for s in counted)  # the run reaches its sparse steps


def test_ddp_and_scape_bytes_worked_by_hand() -> None:
    """N = 32768 fp32 parameters, one bucket, W = 4, C = 4096, d = 0.01: k = round(40.96) = 41 slots per chunk."""
    groups = parameter_groups(numel=32768)
    assert ddp_traffic(ddp_bucket_numels(groups, 25.0)).bytes_sent(4) == 2 * 3 * 32768 * 4 // 4  # 196,608
    assert ddp_traffic(ddp_bucket_numels(groups, 25.0), itemsize=2).bytes_sent(4) == 98304
    cfg = ScapeConfig(density=0.01, dense_warmup_steps=1, density_ramp_steps=0)
    steps = list(ScapeTraffic(scape_layout(groups, 4, cfg), cfg).steps(3))
    # Dense step (ZeRO-1): reduce-scatter 3/4 N b, parameter all-gather 3 (N/4) b, the clipping scalar 2*3/4*4;
    # the end of the warm-up builds the first mask: 3 ranks x 2 chunks x 41 int16 indices.
    assert steps[0].by_traffic(4) == {"dense": 98304 + 98304, "scalars": 6, "indices": 3 * 2 * 41 * 2}
    # Sparse step: values 3/4 * 8 chunks * 41 * 4 B, parameters 3 * 2 chunks * 41 * 4 B, next mask's indices.
    assert steps[1].by_traffic(4) == {"values": 984, "params": 984, "indices": 492, "scalars": 6}
    assert steps[1].bytes_sent(4) == 2466


def test_a_parameter_count_lays_out_like_parameters_of_that_size() -> None:
    groups = parameter_groups(numel=5 * 2**20 + 7)
    assert sum(p.numel() for p in groups[0]["params"]) == 5 * 2**20 + 7
    assert all(p.device.type == "meta" for p in groups[0]["params"])
    with pytest.raises(ValueError, match="parameter count >= 1"):
        parameter_groups(numel=0)


# ------------------------------------------------------------------------------------------- step model


def test_ring_time_is_bytes_over_the_link_plus_a_latency_per_ring_step() -> None:
    one = Cluster(2, 1, MB_PER_S)
    ar = Collective("all_reduce", "dense", 250_000, 4)  # 1 MB sent per rank at W = 2
    assert one.seconds(ar) == pytest.approx(1.0)
    slow = Cluster(2, 1, Link(8e6, latency_s=0.01, efficiency=1.0))
    assert slow.seconds(ar) == pytest.approx(1.0 + 2 * 0.01)  # 2 (W-1) ring steps
    assert slow.seconds(Collective("all_gather", "params", 250_000, 4)) == pytest.approx(1.0 + 0.01)
    # 4 nodes x 8 processes: a ring of 32 ranks, paced by each node's link to the next.
    big = Cluster(4, 8, MB_PER_S)
    assert big.seconds(ar) == pytest.approx(all_reduce_bytes(250_000, 4, 32) / 1e6)
    assert Cluster(1, 1, MB_PER_S).seconds(ar) == 0.0
    assert Link(8e6).bytes_per_s == pytest.approx(0.95e6)  # TCP's 95% by default


def test_step_time_overlaps_the_bucket_collectives_with_the_backward_pass_by_hand() -> None:
    compute = StepCompute(forward_s=1.0, backward_s=2.0, optimizer_s=0.5)
    cluster = Cluster(2, 1, MB_PER_S)
    four = StepTraffic(backward=(Collective("all_reduce", "dense", 250_000, 4, count=4),))  # 4 buckets of 1 s
    # The gradients arrive evenly over the 2 s backward pass: max(last bucket 1 s, 4 s - 2 s * (1 - 1/4)) = 2.5 s.
    t = step_time(four, compute, cluster)
    assert (t.exposed_s, t.wire_s, t.total_s) == pytest.approx((2.5, 4.0, 6.0))
    one = StepTraffic(backward=(Collective("all_reduce", "dense", 250_000, 4),))
    assert step_time(one, compute, cluster).exposed_s == pytest.approx(1.0)  # one bucket: nothing to overlap
    # What the optimizer step waits for is exposed; the index all-gathers hide under the next forward pass.
    rest = StepTraffic(
        after=(Collective("all_gather", "params", 125_000, 4),),
        next_forward=(Collective("all_gather", "indices", 750_000, 2),),
    )
    assert step_time(rest, compute, cluster).exposed_s == pytest.approx(0.5 + (1.5 - 1.0))
    assert step_time(rest, compute, cluster, extra_s=0.25, overlap_next=False).total_s == pytest.approx(
        3.5 + 0.25 + 2.0
    )


def test_schedule_cost_finds_where_the_run_gets_ahead_by_hand() -> None:
    # Three schedule steps of 2 s against the reference's 1.5 s: 1.5 s behind; then 0.5 s saved a step.
    cost = schedule_cost([2.0, 2.0, 2.0], [10, 10, 10], 2, StepTime(1.5, 0, 0), 7, StepTime(1.0, 0, 0))
    assert (cost.dense_steps, cost.ramp_steps, cost.scape_bytes, cost.reference_bytes) == (2, 1, 30, 21)
    assert cost.ahead_from == 3 + 3
    never = schedule_cost([1.0], [1], 1, StepTime(1.5, 0, 0), 1, StepTime(2.0, 0, 0))
    assert never.ahead_from is None
    early = schedule_cost([2.0, 1.2, 1.0], [1, 1, 1], 1, StepTime(1.5, 0, 0), 1, StepTime(1.0, 0, 0))
    assert early.ahead_from == 3  # 0.5 s and 0.2 s behind after steps 1 and 2, 0.3 s ahead after step 3


def _estimate(
    bps: float = 1e9, extra_s: float = 0.003, run_steps: int | None = None, config: ScapeConfig | None = None
) -> Estimate:
    """A 20M-parameter model on two nodes, SCAPE's form fixed (fp32 at each density) unless ``config`` says."""
    compute = StepCompute.from_total(0.05, {0.1: extra_s, 0.01: extra_s})
    config = config or ScapeConfig(density=0.01)
    groups = parameter_groups(numel=20_000_000)
    return estimate(groups, Cluster(2, 1, Link(bps)), compute, config=config, run_steps=run_steps)


@pytest.mark.parametrize("extra_s", [0.003, 0.02])
def test_the_breakeven_rate_is_where_the_predicted_steps_are_equal(extra_s: float) -> None:
    est = _estimate(extra_s=extra_s)
    groups = parameter_groups(numel=20_000_000)
    compute = est.compute
    for d in (0.1, 0.01):
        m = est.method(scape_name(d))
        assert m.breakeven_bps is not None
        for ref_name, itemsize in ((DDP, None), (DDP_BF16, 2)):
            bps = m.breakeven_bps[ref_name]
            assert 0 < bps < math.inf
            ref = ddp_traffic(ddp_bucket_numels(groups, 25.0), itemsize=itemsize)

            # d = 0.01: its time to the same loss (x1.4 the steps); d = 0.1, whose steps are not measured: its step.
            factor = {0.1: 1.0, 0.01: 1.4}[d]
            assert m.steps_factor == (None if d == 0.1 else factor)

            def gap(rate: float, _ref: StepTraffic = ref, _d: float = d, _f: float = factor) -> float:
                at = Cluster(2, 1, Link(rate))
                scape = estimate(groups, at, compute, [_d]).method(scape_name(_d))
                return step_time(_ref, compute, at).total_s - _f * scape.step.total_s

            assert gap(bps) == pytest.approx(0.0, abs=1e-9)
            assert gap(bps / 2) > 0 > gap(bps * 2)  # SCAPE faster below, slower above


def test_without_its_own_work_a_faster_step_still_pays_only_below_a_rate_where_its_steps_are_counted() -> None:
    compute = StepCompute.from_total(0.05)  # no extra work given: per step, SCAPE d=0.01 only saves
    est = estimate(parameter_groups(numel=20_000_000), Cluster(2, 1, Link(1e9)), compute)
    scape = est.method(scape_name(0.01))
    assert not scape.extra_counted and scape.step.total_s < est.method(DDP).step.total_s
    # Per step it is faster at every rate; x1.4 the steps, DDP reaches the loss first on a fast enough link.
    assert scape.breakeven_bps is not None and 0 < scape.breakeven_bps[DDP] < math.inf
    text = format_estimate(est, "20M", "given")
    assert "SCAPE d=0.01 reaches the same loss sooner than DDP + AdamW below" in text and "(x1.4 the steps" in text
    assert "SCAPE d=0.1's step is faster than DDP + AdamW below" in text  # its steps to the loss: not measured
    assert "per step only: the steps it needs to the same loss at this density are not measured" in text
    assert "every rate" not in text


def test_recommendation_follows_the_link() -> None:
    slow, fast = _estimate(bps=1e8), _estimate(bps=1e11)
    assert slow.recommendation.startswith("Use SCAPE d=0.01")
    assert "DDP" in fast.recommendation and not fast.recommendation.startswith("Use SCAPE")
    ahead = slow.method(scape_name(0.01)).schedule
    assert ahead is not None and ahead.ahead_from is not None
    short = _estimate(bps=1e8, run_steps=ahead.ahead_from - 1)  # ends before SCAPE has caught up
    assert short.recommendation.startswith("Use DDP bf16 hook + AdamW for this run")
    assert "shorten --dense-warmup-steps and --density-ramp-steps" in short.recommendation


@pytest.mark.parametrize(
    ("bps", "form"), [(1e8, "int8 d=0.01"), (2e9, "int8 d=0.025"), (1e10, "int8 dense"), (1e12, "fp32 dense")]
)
def test_with_the_defaults_it_says_which_form_the_run_would_choose_and_how_to_fix_it(bps: float, form: str) -> None:
    est = _estimate(bps=bps, config=ScapeConfig())
    assert est.chosen_form is not None and est.chosen_form.name == form
    assert est.recommendation.startswith(f"SCAPE's defaults would run {form} on this cluster")
    assert f"ScapeStrategy({est.chosen_form.settings()})" in est.recommendation
    # The run's pilot predicts the same from the same model, given the same compute and link.
    layout = scape_layout(parameter_groups(numel=20_000_000), 2, ScapeConfig().start_form())
    cluster = Cluster(2, 1, Link(bps))
    ours = forms.predict(forms.candidates(True), layout, ScapeConfig(), cluster, {forms.FP32_DENSE: 0.05})
    assert forms.choose(ours, forms.FP32_DENSE) == est.chosen_form


def test_the_int8_wire_adds_scape_with_every_step_dense() -> None:
    """Its step sends the int8 dense packets both ways: a quarter of DDP's fp32 bytes, plus one scale per 256."""
    groups = parameter_groups(numel=20_000_000)
    compute = StepCompute.from_total(0.05, {0.1: 0.003, 0.01: 0.003})
    est = estimate(groups, Cluster(2, 1, Link(5e9)), compute, config=ScapeConfig(wire_format="int8"), run_steps=5000)
    m = est.method(SCAPE_INT8_DENSE)
    assert m.density is None and m.schedule is None
    # W = 2: each rank sends half its gradient's codes and scales, then half the parameter changes' (the padding to
    # W * C and to 4-byte packets is a few kB).
    assert m.bytes_per_step == pytest.approx(20_000_000 * (1 + 4 / 256), rel=1e-3)
    assert m.bytes_per_step / est.method(DDP).bytes_per_step == pytest.approx(0.254, abs=0.001)
    assert m.run_s == pytest.approx(5000 * m.step.total_s)
    # At 5 Gbit/s its steps beat the bf16 hook's and the sparse steps do not beat them by SPARSE_STEPS.
    assert est.recommendation.startswith('Use SCAPE int8 dense (wire_format="int8", dense_warmup_steps=5000)')
    slow = estimate(groups, Cluster(2, 1, Link(1e8)), compute, config=ScapeConfig(wire_format="int8"))
    assert slow.recommendation.startswith("Use SCAPE int8 d=0.01")  # the int8 rows say so
    fast = estimate(groups, Cluster(2, 1, Link(3e10)), compute, config=ScapeConfig(wire_format="int8"))
    assert fast.recommendation.startswith("Stay with DDP bf16 hook + AdamW: SCAPE int8 dense's steps are predicted")
    assert "% slower (its parameter all-gather is not hidden)" in fast.recommendation
    # Without the int8 wire (or replicated) there is no such row.
    assert all(x.name != SCAPE_INT8_DENSE for x in _estimate().methods)


def test_a_fixed_form_is_recommended_on_its_time_to_the_same_loss_not_on_its_step() -> None:
    # Find a link where SCAPE d=0.01's step beats DDP's by more than CLEAR_GAIN, but not by the 1.4x steps it needs.
    rates = [1e9 * 1.1**i for i in range(60)]
    ests = [_estimate(bps=bps) for bps in rates]
    step_gain = [e.method(DDP).step.total_s / e.method(scape_name(0.01)).step.total_s for e in ests]
    between = [e for e, g in zip(ests, step_gain, strict=True) if 1.15 < g < 1.35]
    assert between, step_gain
    for est in between:
        assert not est.recommendation.startswith("Use SCAPE"), est.recommendation
        assert "reach the same loss" in est.recommendation
    slow = _estimate(bps=1e8)
    assert "reach the same loss" in slow.recommendation and "(its steps are 1.4x as many)" in slow.recommendation


def test_the_default_schedule_is_the_configs() -> None:
    est = _estimate(bps=1e8, run_steps=1000)
    cfg = ScapeConfig()
    for d in (0.1, 0.01):
        m = est.method(scape_name(d))
        assert m.schedule is not None
        assert m.schedule.dense_steps == cfg.replace(density=d).dense_steps  # 150 at d = 0.01, 270 at 0.1
        assert m.schedule.dense_steps + m.schedule.ramp_steps == cfg.dense_warmup_steps + cfg.density_ramp_steps
    ddp = est.method(DDP)
    assert ddp.run_s == pytest.approx(1000 * ddp.step.total_s)


# ------------------------------------------------------------------------------------------------ memory


def test_memory_worked_by_hand() -> None:
    """32768 fp32 parameters, W = 4, C = 4096, d = 0.01 without a ramp: 41 slots per chunk, 8 chunks, 2 per shard."""
    cfg = ScapeConfig(density=0.01, dense_warmup_steps=1, density_ramp_steps=0)
    mem = scape_memory(scape_layout(parameter_groups(numel=32768), 4, cfg), cfg)
    assert (mem.params, mem.grads) == (32768 * 4, 32768 * 4)
    assert mem.optimizer == 32768 * 4 + 8192 * 4 + 8192 * 4  # residual; momentum and last-sent of the shard
    compact = 8 * 41 * 4 + 2 * 41 * 4 + 2 * 41 * 4 + 8 * 41 * 4  # values, received, updated, gathered
    assert mem.buffers == compact + max(2 * 8 * 41 * 2, 8192 * 4)  # 2 masks, or the warm-up's gradient shard
    # The optimizer part is what a checkpoint's rank file holds (docs/lightning.md): 4 + 8/W bytes per parameter.
    assert mem.optimizer / 32768 == 4 + 8 / 4


def test_memory_of_the_defaults_holds_every_momentum_as_their_ddp_form_does() -> None:
    """The same model with SCAPE choosing its form: its fp32 dense steps hold the whole momentum on every rank."""
    cfg = ScapeConfig()
    mem = scape_memory(scape_layout(parameter_groups(numel=32768), 4, cfg.start_form()), cfg)
    assert mem.optimizer == 32768 * 4 + 32768 * 4 + 8192 * 4  # residual, momentum; last-sent steps of the shard

    def held(rank: int, comm: Communicator) -> tuple[int, int]:
        model = _net()
        engine = ScapeEngine(AdamS(_groups(model), lr=1e-3), ScapeConfig(chunk_size=64), comm)
        tensors = [t for bs in engine.buckets for t in (bs.params, bs.grads, bs.residual, bs.momentum, bs.last_sent)]
        layout = [bs.layout for bs in engine.buckets]
        engine.close()
        predicted = scape_memory(layout, ScapeConfig(chunk_size=64), rank)
        return sum(
            t.numel() * t.element_size() for t in tensors
        ), predicted.params + predicted.grads + predicted.optimizer

    for engine_bytes, predicted_bytes in simulate(2, held):
        assert engine_bytes == predicted_bytes


def test_memory_equals_the_engines_buffers() -> None:
    cfg = ScapeConfig(density=0.02, chunk_size=64, dense_warmup_steps=1, density_ramp_steps=0)
    model = _net()
    engine = ScapeEngine(AdamS(_groups(model), lr=1e-3), cfg)
    held = sum(
        t.numel() * t.element_size()
        for bs in engine.buckets
        for t in (bs.params, bs.grads, bs.residual, bs.momentum, bs.last_sent)
    )
    mem = scape_memory(scape_layout(_groups(_net()), 1, cfg), cfg)
    assert mem.params + mem.grads + mem.optimizer == held


# -------------------------------------------------------------------------------------------- the command


def test_rates_and_counts_read_as_a_user_writes_them() -> None:
    assert link_rate("25gbit") == 25e9 and link_rate("100Mbit/s") == 1e8 and link_rate("1.5Gbps") == 1.5e9
    assert parameter_count("1.2B") == 1_200_000_000 and parameter_count("160M") == 160_000_000
    assert parameter_count("7e9") == 7_000_000_000 and parameter_count("pythia-160m") is None


def test_the_command_prints_the_table_with_the_package_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "160M", "--nodes", "2", "--bandwidth", "1gbit", "--compute-ms", "120", "--steps", "2000"]
    est = estimate_command([*argv, "--scape-extra-ms", "9"])
    out = capsys.readouterr().out
    ddp_mb = all_reduce_bytes(160_000_000, 4, 2) / 1e6
    row = next(line for line in out.splitlines() if line.startswith(DDP + " "))
    assert float(row.split()[3]) == pytest.approx(ddp_mb, abs=1e-3)
    assert est.method(DDP).bytes_per_step == all_reduce_bytes(160_000_000, 4, 2)
    prose = " ".join(out.split())  # the prose is wrapped
    assert "9.0 ms at d=0.1, 9.0 ms at d=0.01" in prose and "A run of 2000 steps" in prose
    assert "Recommendation: SCAPE's defaults would run " in prose and "To fix it: ScapeStrategy(" in prose
    assert "The forms SCAPE chooses from" in out and "int8 dense" in out
    assert "SCAPE d=0.01: the first 150 steps are dense" in prose
    assert max(len(line) for line in out.splitlines()) <= 110


GOOD = ["--model", "160M", "--nodes", "2", "--bandwidth", "1gbit"]
ERRORS = [
    ([*GOOD[:-1], "25", "--compute-ms", "9"], "'25' is not a link rate; give a number and a unit: 25gbit, 100mbit"),
    (["--model", "1B", "--nodes", "1", "--bandwidth", "1gbit", "--compute-ms", "9"], "one process sends nothing"),
    (GOOD, "give one of --compute-ms MS"),
    ([*GOOD, "--compute-ms", "9", "--measure"], "give one of --compute-ms MS"),
    ([*GOOD, "--compute-ms", "0"], "--compute-ms must be > 0"),
    ([*GOOD, "--compute-ms", "9", "--densities", "2"], "density=2.0 must lie in (0, 1]"),
    ([*GOOD, "--compute-ms", "9", "--scape-extra-ms", "1,2,3"], "give one value or one per density (2), got 3"),
    ([*GOOD, "--measure"], "--measure runs the model: name a litgpt config"),
    ([*GOOD, "--compute-ms", "9", "--steps", "0"], "--steps must be at least 1"),
    (["--model", "pythia-16Om", *GOOD[2:], "--compute-ms", "9"], "'pythia-16Om' is neither a parameter count"),
]


@pytest.mark.parametrize(("argv", "message"), ERRORS, ids=[m[:32] for _, m in ERRORS])
def test_bad_options_get_one_line_that_says_what_to_give(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        estimate_command(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("lightning-scape estimate: error: ") and message in lines[-1], lines
    assert sum("error" in line for line in lines) == 1, lines  # the usage, then one line


def test_the_int8_wire_is_estimated_with_its_packets(capsys: pytest.CaptureFixture[str]) -> None:
    """``--wire-format int8`` prices SCAPE's steps with the int8 packets: the planner's bytes, not fp32's."""
    argv = ["--model", "1B", "--nodes", "4", "--bandwidth", "10gbit", "--compute-ms", "500", "--densities", "0.01"]
    estimate_command(argv)
    full = capsys.readouterr().out
    estimate_command([*argv, "--wire-format", "int8"])
    int8 = capsys.readouterr().out

    def scape_mb(out: str) -> float:
        (row,) = [line for line in out.splitlines() if line.startswith(("SCAPE d=0.01 ", "SCAPE int8 d=0.01 "))]
        return float(row.split("d=0.01", 1)[1].split()[0])

    # Per sparse step and rank: fp32 sends 10 bytes a slot, int8 about 4.2 (the indices stay int16).
    assert 0.40 < scape_mb(int8) / scape_mb(full) < 0.45


def test_a_litgpt_config_name_is_laid_out_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("litgpt")
    est = estimate_command(["--model", "pythia-14m", "--nodes", "2", "--bandwidth", "1gbit", "--compute-ms", "50"])
    from litgpt import GPT, Config

    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(Config.from_name("pythia-14m")).parameters())
    assert est.params == n
    assert est.method(DDP).bytes_per_step == all_reduce_bytes(n, 4, 2)


def test_the_measured_dry_run_fills_the_compute_and_scapes_own_work(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_scape.planning.measure import measure_compute

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(16, 24), torch.randn(16, 64)

    compute = measure_compute(_net, batch, lambda m, x, y: (m(x) - y).square().mean(), 2, [0.1], steps=2, warmup=1)
    assert compute.forward_s > 0 and compute.backward_s > 0 and compute.optimizer_s > 0
    assert compute.has_extra(0.1) and compute.extra(0.1) >= 0


def test_estimate_is_listed_and_its_help_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert any(line.split(None, 1)[:1] == ["estimate"] for line in capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--help"])
    assert exit_info.value.code == 0 and "--bandwidth" in capsys.readouterr().out


@pytest.mark.dist
def test_estimate_help_and_errors_answer_without_importing_torch() -> None:
    script = (
        "import sys, lightning_scape_cli as cli\n"
        "for argv in (['estimate', '--help'], ['estimate', '--model', '1B', '--nodes', '1', '--bandwidth', '1gbit',"
        " '--compute-ms', '5']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--bandwidth" in proc.stdout and "exit 0" in proc.stdout and "exit 2" in proc.stdout
    assert "one process sends nothing" in proc.stderr
    assert proc.stdout.rstrip().endswith("torch imported: False"), proc.stdout


def test_the_readme_example_prints_what_the_readme_shows(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in readme.split("```\n") if b.startswith("lightning-scape estimate "))
    command, shown = block.split("\n", 1)
    estimate_command(command.split()[2:])
    assert capsys.readouterr().out == shown
