"""The int8 wire format (``wire_format="int8"``): no gradient mass lost, replicas bitwise equal, bytes = packets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_net, reference_dense_adams, rel_err, run_worker

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import ByteCounters, Communicator, Wire
from lightning_scape.comm.int8_packets import packet_bytes
from lightning_scape.engine.step import StepInFlight
from lightning_scape.planning.traffic import ScapeTraffic

INT8 = {"density": 0.1, "chunk_size": 64, "dense_warmup_steps": 3, "density_ramp_steps": 4, "wire_format": "int8"}


def test_packets_worked_by_hand() -> None:
    # 41 values in one group: one fp32 scale and 41 codes, padded to 48 bytes; 512 values in groups of 256: 2
    # scales and 512 codes.
    assert packet_bytes(41, 41) == 4 + 44
    assert packet_bytes(512, 256) == 8 + 512


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_wire_sums_and_gathers_what_each_rank_rounded_and_keeps_the_rest(world_size: int) -> None:
    W, n, group = world_size, 2 * 41, 41

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        wire = Wire(comm, ByteCounters())
        gen = torch.Generator().manual_seed(rank)
        values = torch.randn(W * n, generator=gen)
        update = torch.randn(n, generator=gen)
        summed, held = torch.empty(n), torch.full((W * n,), 3.0)
        sent_values, sent_update = values.clone(), update.clone()
        wire.wait(wire.reduce_scatter_int8("values", summed, values, group))
        wire.wait(wire.all_gather_int8("params", held, update, group))
        return {
            "carried": sent_values - values,  # what left this rank: the input less the error it kept
            "carried_update": sent_update - update,
            "summed": summed,
            "held": held,
            "sent": dict(wire.counters.step_sent),
        }

    out = simulate(W, worker)
    for r in range(W):
        expected = out[0]["carried"][r * n : (r + 1) * n].clone()
        for other in out[1:]:
            expected += other["carried"][r * n : (r + 1) * n]
        assert torch.equal(out[r]["summed"], expected)
        assert torch.equal(out[r]["held"], out[0]["held"])  # every rank decodes every packet alike
        for q in range(W):
            assert torch.equal(out[r]["held"][q * n : (q + 1) * n], 3.0 + out[q]["carried_update"])
        assert out[r]["sent"]["values"] == (W - 1) * packet_bytes(n, group)
        assert out[r]["sent"]["params"] == (W - 1) * packet_bytes(n, group)
    assert (out[0]["carried"] - torch.randn(W * n, generator=torch.Generator().manual_seed(0))).abs().max() < 0.02


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_stay_bitwise_equal_and_each_step_sends_its_packets(world_size: int) -> None:
    W = world_size
    spec = {"steps": 12, "config": INT8}
    out = simulate(W, lambda rank, comm: run_worker(rank, comm, spec))
    for step in range(12):
        for r in range(1, W):
            assert torch.equal(out[0]["params"][step], out[r]["params"][step]), (step, r)
    k = ScapeConfig(**INT8).slots_for
    dense = sparse = 0
    for P, C in out[0]["layout"]:  # per bucket: a reduce-scatter and an all-gather of packets
        per_rank = P // W
        dense += 2 * (W - 1) * packet_bytes(per_rank, min(256, C))
        slots = per_rank // C * k(C)
        sparse += 2 * (W - 1) * packet_bytes(slots, k(C)) + (W - 1) * slots * 2  # and the int16 indices
    assert [sum(s.values()) for s in out[0]["sent"][:3]] == [dense] * 3
    assert [sum(s.values()) for s in out[0]["sent"][-3:]] == [sparse] * 3


def test_a_tiny_bucket_with_chunks_sized_to_it() -> None:
    """A bucket too small for its chunk size gets chunks of ceil(numel / W), not a power of two: its dense steps
    take the largest power-of-two group that divides the shard, and the planner counts the same packets."""

    def worker(rank: int, comm: Communicator) -> tuple[torch.Tensor, list[dict[Any, int]], list[Any]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        cfg = ScapeConfig(**{**INT8, "chunk_size": 1024})
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm, param_order=list(model.parameters()))
        gen = torch.Generator().manual_seed(rank)
        sent = []
        for _ in range(10):
            model(torch.randn(8, 64, generator=gen)).square().mean().backward()
            engine.step(max_grad_norm=1.0)
            engine.zero_grad()
            sent.append({k: v for k, v in engine.counters.step_sent.items() if v})
        layouts = [bs.layout for bs in engine.buckets]
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), sent, layouts

    (a, sent, layouts), (b, _, _) = simulate(2, worker)
    assert torch.equal(a, b)
    assert any(lay.chunk_size & (lay.chunk_size - 1) for lay in layouts)  # a chunk size that is not a power of two
    planned = ScapeTraffic(layouts, ScapeConfig(**{**INT8, "chunk_size": 1024})).steps(10)
    assert [{k: v for k, v in s.by_traffic(2).items() if v} for s in planned] == sent


def test_the_dense_steps_stay_close_to_data_parallel_adams() -> None:
    # The rounding of a step's update is dropped, and a small gradient may wait in the residual for a step or two:
    # the parameters drift from dense AdamS by a fraction of one step's update, not more.
    spec = {"steps": 3, "config": {**INT8, "dense_warmup_steps": 3}}
    int8 = simulate(2, lambda rank, comm: run_worker(rank, comm, spec))[0]["params"]
    ref = reference_dense_adams(spec, 2)
    start = torch.cat([p.detach().reshape(-1) for p in make_net(0).parameters()])
    for step in range(3):
        moved = rel_err(ref[step], start)
        assert 0.0 < rel_err(int8[step], ref[step]) < 0.5 * moved, step


def test_no_gradient_mass_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integer fp64 gradients (exact sums): on every coordinate, what the owner applied is the average of what
    left the ranks (gradient plus old residual less new residual), in the dense and in the sparse steps."""
    W, steps = 2, 8
    synced: dict[int, list[list[torch.Tensor]]] = {r: [] for r in range(W)}
    real = StepInFlight.synced_grads

    def spy(self: StepInFlight) -> list[torch.Tensor]:
        grads = real(self)
        rank = self.wire.comm.rank
        if len(synced[rank]) < self.step:
            synced[rank].append([g.clone() for g in grads])
        return grads

    monkeypatch.setattr(StepInFlight, "synced_grads", spy)

    def worker(rank: int, comm: Communicator) -> list[dict[str, torch.Tensor]]:
        cfg = ScapeConfig(**{**INT8, "dense_warmup_steps": 2, "density_ramp_steps": 0})
        model = make_net(0, torch.float64)
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm)
        (bs,) = engine.buckets
        gen = torch.Generator().manual_seed(rank)
        records = []
        for _ in range(steps):
            mask = None if engine.in_warmup else engine.current_masks()[0].clone()
            for p in model.parameters():
                p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
            before = bs.residual.clone()
            engine.step()
            left = before + bs.grads - bs.residual  # what this rank sent for good
            records.append({"left": left, "mask": mask, "region": torch.tensor([bs.region.start, bs.region.stop])})
            engine.zero_grad()
        engine.close()
        return records

    out = simulate(W, worker)
    from lightning_scape.kernels import mask_positions

    for t in range(steps):
        total = sum(out[r][t]["left"] for r in range(W))
        for r in range(W):
            start, stop = out[r][t]["region"].tolist()
            (applied,) = synced[r][t]
            mask = out[r][t]["mask"]
            if mask is None:  # dense: every coordinate of the region
                assert torch.equal(applied * W, total[start:stop]), t
                continue
            pos = mask_positions(mask, 64)
            region_pos = pos[(pos >= start) & (pos < stop)]
            assert torch.equal(applied * W, total[region_pos]), t
            outside = torch.ones_like(total, dtype=torch.bool)
            outside[pos] = False
            assert torch.equal(total[outside], torch.zeros_like(total[outside])), t  # unsent: all in the residual


def test_int8_needs_sharded_mode() -> None:
    with pytest.raises(ValueError, match="wire_format='int8' needs sharded=True"):
        ScapeConfig(wire_format="int8", sharded=False)
    with pytest.raises(ValueError, match="wire_format='bf8' is unknown"):
        ScapeConfig(wire_format="bf8")  # type: ignore[arg-type]


def _fp16_like_run(rank: int, comm: Communicator, staged: bool, bad_step: int | None) -> dict[str, Any]:
    """The int8 wire through dense and sparse steps, with the finiteness vote of fp16 loss scaling (``staged``);
    rank 1's gradient holds an inf at ``bad_step``."""
    cfg = ScapeConfig(**INT8)
    model = make_net(0)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm, skip_nonfinite=staged)
    (bs,) = engine.buckets
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"params": [], "residual": [], "skipped": []}
    for step in range(10):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        if step == bad_step and rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")  # type: ignore[index]
        engine.step()
        engine.zero_grad()
        out["params"].append(bs.params.clone())
        out["residual"].append(bs.residual.clone())
        out["skipped"].append(engine.last_step_skipped)
    engine.close()
    return out


@pytest.mark.parametrize("bad_step", [1, 8])  # a dense step and a sparse one
def test_fp16_skipped_steps_leave_no_trace_and_finite_ones_match_the_unstaged_run(bad_step: int) -> None:
    plain = simulate(2, lambda rank, comm: _fp16_like_run(rank, comm, False, None))
    staged = simulate(2, lambda rank, comm: _fp16_like_run(rank, comm, True, None))
    for a, b in zip(plain, staged, strict=True):  # staging the residual changes no bit of a finite run
        pairs = zip(a["params"] + a["residual"], b["params"] + b["residual"], strict=True)
        assert all(torch.equal(x, y) for x, y in pairs)
    skipped = simulate(2, lambda rank, comm: _fp16_like_run(rank, comm, True, bad_step))
    for r in range(2):
        run = skipped[r]
        assert run["skipped"] == [s == bad_step for s in range(10)]
        before = run["params"][bad_step - 1], run["residual"][bad_step - 1]
        assert torch.equal(run["params"][bad_step], before[0])  # nothing applied
        assert torch.equal(run["residual"][bad_step], before[1])  # and nothing kept: no rounding, no gradient
    assert torch.equal(skipped[0]["params"][-1], skipped[1]["params"][-1])
