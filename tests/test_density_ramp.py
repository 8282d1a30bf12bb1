"""The density ramp after the dense warm-up: its schedule, bytes, exact mass conservation and resume."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_batch, param_groups
from helpers import make_net as make_model

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.kernels import mask_positions

RAMP = {"density": 0.05, "chunk_size": 64, "dense_warmup_steps": 2, "density_ramp_steps": 5}


def test_the_schedule_falls_from_dense_to_density() -> None:
    cfg = ScapeConfig(**RAMP)
    k_final = cfg.slots_per_chunk  # round(0.05 * 64) = 3
    # Geometric: density ** (s / R) at ramp step s = 1..R-1 (step 2 + s), then the density itself. Steps denser
    # than 1/4 are sent dense: s = 1 (0.55) and s = 2 (0.30); the sparse ramp starts at s = 3 (0.17).
    assert [cfg.ramp_density(t) for t in (1, 2)] == [1.0, 1.0]
    assert [cfg.ramp_density(t) for t in range(3, 8)] == pytest.approx([0.05 ** (s / 5) for s in range(1, 5)] + [0.05])
    assert cfg.dense_steps == 4
    ks = [cfg.slots_at(t) for t in range(5, 9)]
    assert ks == [round(0.05**0.6 * 64), round(0.05**0.8 * 64), k_final, k_final] == [11, 6, 3, 3]
    assert cfg.max_slots_per_chunk == 11  # the compact buffers' capacity: the first sparse step's slots
    # No warm-up: sparse at the density from the first step, whatever the ramp says.
    no_warmup = cfg.replace(dense_warmup_steps=0)
    assert no_warmup.dense_steps == 0 and no_warmup.max_slots_per_chunk == k_final


def _mass_worker(rank: int, comm: Communicator, steps: int) -> dict[str, Any]:
    """Integer fp64 gradients: every sum is exact. Dense steps send the whole gradient, sparse steps the mask."""
    cfg = ScapeConfig(**RAMP, exploration=0.25)
    model = make_model(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm)
    (bs,) = engine.buckets
    gen = torch.Generator().manual_seed(rank)
    grad_sum, sent = torch.zeros_like(bs.residual), torch.zeros_like(bs.residual)
    slots, bytes_sent = [], []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
        dense = engine.in_warmup
        mask = None if dense else engine.current_masks()[0]
        engine.step()
        grad_sum += bs.grads
        if mask is None:
            sent += bs.grads
        else:
            sent.index_add_(0, mask_positions(mask, cfg.chunk_size), bs.values)
            slots.append(mask.shape[1])
        bytes_sent.append(dict(engine.counters.step_sent))
        engine.zero_grad()
    engine.close()
    return {"grad_sum": grad_sum, "sent": sent, "residual": bs.residual.clone(), "slots": slots,
            "bytes": bytes_sent, "padded": bs.layout.padded_numel}  # fmt: skip


def test_no_gradient_mass_is_lost_through_the_ramp_and_bytes_follow_it() -> None:
    W, steps = 2, 10
    cfg = ScapeConfig(**RAMP)
    results = simulate(W, lambda rank, comm: _mass_worker(rank, comm, steps))
    for r in results:
        assert torch.equal(r["grad_sum"], r["sent"] + r["residual"])
        assert r["residual"].abs().sum() > 0
    # Steps 1..4 are dense; sparse steps 5..10 use the ramp's slots per chunk, then the density's.
    assert results[0]["slots"] == [cfg.slots_at(t) for t in range(5, steps + 1)] == [11, 6, 3, 3, 3, 3]
    chunks = results[0]["padded"] // cfg.chunk_size
    for t, sent in enumerate(results[0]["bytes"][4:], start=5):
        dN = chunks * cfg.slots_at(t)  # the step's slots over all ranks
        assert sent["values"] == (W - 1) * dN * 8 // W  # fp64 values, reduce-scatter
        assert sent["params"] == (W - 1) * dN * 8 // W  # the owners' new values, all-gather
        # The mask for step t + 1 (built at the end of step t) is gathered as int16.
        assert sent["indices"] == (W - 1) * chunks * cfg.slots_at(t + 1) * 2 // W


def test_a_checkpoint_taken_mid_ramp_resumes_bitwise() -> None:
    cfg = ScapeConfig(**RAMP, bucket_cap_mb=1.0)

    def run(model: torch.nn.Module, engine: ScapeEngine, steps: range) -> None:
        for step in steps:
            x, y = make_batch(0, step)
            (model(x) - y).pow(2).mean().backward()
            engine.step()
            engine.zero_grad()

    model = make_model(0)
    engine = ScapeEngine(AdamS(param_groups(model, 1e-2), lr=1e-2), cfg)
    run(model, engine, range(5))  # four dense steps, one sparse ramp step: the queued mask is a ramp mask
    assert engine.current_masks()[0].shape[1] == cfg.slots_at(6) > cfg.slots_per_chunk
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved = engine.state_dict()
    run(model, engine, range(5, 10))

    twin = make_model(1)
    twin.load_state_dict(saved_params)
    twin_engine = ScapeEngine(AdamS(param_groups(twin, 1e-2), lr=1e-2), cfg)
    twin_engine.load_state_dict(saved)
    run(twin, twin_engine, range(5, 10))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
