"""Resuming with other SCAPE settings on purpose (``resume_with_new_config``): the state carries over, masks are
rebuilt, no gradient mass is lost, and the resumed run sends the new density's bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import make_net

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.engine.state import check_config
from lightning_scape.kernels import mask_positions
from lightning_scape.planning.run_traffic import mask_bytes, sparse_step_bytes

OLD = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0, exploration=0.25)
NEW = OLD.replace(density=0.2, exploration=0.1)


def _steps(engine: ScapeEngine, model: torch.nn.Module, rank: int, steps: int, seed: int) -> dict[str, Any]:
    """``steps`` sparse steps of integer fp64 gradients (exact sums): what was given, sent, and each step's bytes."""
    (bs,) = engine.buckets
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    grad_sum, sent, step_bytes = torch.zeros_like(bs.residual), torch.zeros_like(bs.residual), []
    for _ in range(steps):
        positions = mask_positions(engine.current_masks()[0], engine.config.chunk_size)
        for p in model.parameters():
            p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
        engine.step()
        grad_sum += bs.grads
        sent.index_add_(0, positions, bs.values)
        step_bytes.append(dict(engine.counters.step_sent))
        engine.zero_grad()
    return {"grad_sum": grad_sum, "sent": sent, "bytes": step_bytes, "residual": bs.residual.clone()}


def test_a_new_density_carries_momentum_and_residual_over_and_loses_no_gradient_mass() -> None:
    def before(rank: int, comm: Communicator) -> dict[str, Any]:
        model = make_net(0, torch.float64)
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), OLD, comm)
        out = _steps(engine, model, rank, 6, seed=1)
        out.update(state=engine.state_dict(), params=[p.detach().clone() for p in model.parameters()])
        engine.close()
        return out

    saved = simulate(2, before)
    states = [s["state"] for s in saved]

    def after(rank: int, comm: Communicator) -> dict[str, Any]:
        model = make_net(0, torch.float64)
        with torch.no_grad():
            for p, q in zip(model.parameters(), saved[rank]["params"], strict=True):
                p.copy_(q)  # the weights come with the model's own state dict
        engine = ScapeEngine(
            AdamS(model.parameters(), lr=1e-3), NEW, comm, sync_params=False, resume_with_new_config=True
        )
        engine.load_state_dict(engine.reshard_state_dicts(states))
        (bs,) = engine.buckets
        loaded = {"loaded_momentum": bs.momentum.clone(), "loaded_residual": bs.residual.clone(), "layout": [bs.layout]}
        out = _steps(engine, model, rank, 5, seed=2)
        engine.close()
        return {**out, **loaded}

    resumed = simulate(2, after)
    old_state = [s["buckets"][0] for s in states]
    # Momentum and the global unsent gradient (the sum of the residuals) carried over.
    for r in range(2):
        assert torch.equal(resumed[r]["loaded_momentum"], old_state[r]["momentum"])
    assert torch.equal(sum(r["loaded_residual"] for r in resumed), sum(s["residual"] for s in old_state))
    # No mass lost over both runs: every gradient given was sent, or is still in a residual.
    given = sum(r["grad_sum"] for r in saved + resumed)
    accounted = sum(r["sent"] for r in saved + resumed) + sum(r["residual"] for r in resumed)
    assert torch.equal(given, accounted)
    # The resumed run sends the new density's values and parameters (and builds its masks at it).
    (layout,) = resumed[0]["layout"]
    for step, sent in enumerate(resumed[0]["bytes"], start=7):
        assert sent["values"] + sent["params"] == sparse_step_bytes([layout], NEW, 2, step)
        assert sent["indices"] == mask_bytes([layout], NEW, 2, step + 1)
    assert sparse_step_bytes([layout], NEW, 2, 7) > 3 * sparse_step_bytes([layout], OLD, 2, 7)


def test_without_the_option_other_settings_are_refused_and_the_layout_never_changes() -> None:
    saved = OLD.to_dict()
    with pytest.raises(ValueError, match=r"'density': \(0.05, 0.2\).*resume_with_new_config=True"):
        check_config(OLD.replace(density=0.2), saved)
    check_config(NEW, saved, resume_with_new_config=True)  # density, exploration: carried over
    for field, value in (("chunk_size", 128), ("sharded", False), ("bucket_cap_mb", 1.0)):
        with pytest.raises(ValueError, match=rf"'{field}'.*how the state is laid out"):
            check_config(NEW.replace(**{field: value}), saved, resume_with_new_config=True)
