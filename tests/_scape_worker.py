"""A deterministic small training run of the engine, for one rank of W (simulated or real gloo).

``run_worker(rank, comm, spec)`` builds the same model on every rank, feeds rank-specific data, and
records what the tests compare: parameters after every step, byte counters, masks, residuals.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine
from lightning_scape.comm import Communicator

IN, HID, OUT = 24, 40, 8


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Three linear layers (about 2.6k parameters), identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(dtype)


def make_batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific data."""
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    x = torch.randn(16, IN, generator=g)
    y = torch.randn(16, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def param_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Weights with decay, biases without (two param groups, as LLM recipes do)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one fp64 vector (model order)."""
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def run_worker(rank: int, comm: Communicator, spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``spec["steps"]`` steps; return per-step parameters and counters, and the final state."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    cfg = ScapeConfig(**spec["config"])
    model = make_model(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    engine = ScapeEngine(opt, cfg, comm, param_order=list(model.parameters()))
    out: dict[str, Any] = {"params": [], "sent": [], "dense_eq": [], "masks_used": [], "masks_built": []}
    for step in range(spec["steps"]):
        x, y = make_batch(rank, step, dtype)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_used"].append([m.clone() for m in engine.current_masks()])
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        engine.step(max_grad_norm=spec.get("max_grad_norm"))
        engine.zero_grad()
        out["params"].append(flat_params(model))
        out["sent"].append(dict(engine.counters.step_sent))
        out["dense_eq"].append(engine.counters.step_dense_equivalent)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_built"].append([m.clone() for m in engine.last_built_masks()])
    out["padded_numel"] = engine.padded_numel
    out["numel"] = engine.numel
    out["slots"] = engine.slots
    out["residual"] = [bs.residual.clone() for bs in engine.buckets]
    engine.close()
    return out


def reference_dense_adams(spec: dict[str, Any], world_size: int) -> list[torch.Tensor]:
    """Data-parallel AdamS in one process: average the W ranks' gradients, then ``AdamS.step``."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = make_model(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    params = []
    for step in range(spec["steps"]):
        grads = []
        for r in range(world_size):
            model.zero_grad(set_to_none=True)
            x, y = make_batch(r, step, dtype)
            (model(x) - y).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        if spec.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        params.append(flat_params(model))
    return params


def mass_worker(rank: int, comm: Communicator, steps: int) -> dict[str, torch.Tensor]:
    """Integer-valued fp64 gradients (so every sum is exact); returns sum g, what was sent, the residual."""
    from lightning_scape.kernels import mask_positions

    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0, exploration=0.25)
    model = make_model(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm)
    (bs,) = engine.buckets  # one bucket: the whole model fits under bucket_cap_mb
    gen = torch.Generator().manual_seed(rank)
    grad_sum = torch.zeros_like(bs.residual)
    sent = torch.zeros_like(bs.residual)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
        mask = engine.current_masks()[0]
        engine.step()  # no backward: the step synchronises the gradients it finds
        grad_sum += bs.grads
        sent.index_add_(0, mask_positions(mask, cfg.chunk_size), bs.values)
        engine.zero_grad()
    engine.close()
    return {"grad_sum": grad_sum, "sent": sent, "residual": bs.residual.clone()}


def _process_group_comm() -> Communicator:
    from lightning_scape import ProcessGroupCommunicator

    return ProcessGroupCommunicator(timeout_s=60)


def gloo_run_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_worker` on the default (gloo) process group."""
    return run_worker(rank, _process_group_comm(), spec)


def gloo_mass_worker(rank: int, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """:func:`mass_worker` on the default (gloo) process group."""
    return mass_worker(rank, _process_group_comm(), steps)
