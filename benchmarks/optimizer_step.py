"""Optimizer-step time of SCAPE against dense AdamW and AdamS on one model (W = 1), and memory per parameter.

    python benchmarks/optimizer_step.py                       # litgpt pythia-14m on the CPU
    python benchmarks/optimizer_step.py --model pythia-70m --device cuda

Only the step is timed: gradients are fixed random tensors, so the numbers compare optimizer work. The
methods run interleaved, round by round, and each one's median over all rounds is reported, so that
machine noise hits every method alike. Memory per parameter counts the optimizer's own state (AdamW:
exp_avg + exp_avg_sq; SCAPE: residual, momentum, last-sent steps, masks and compact buffers; the
parameters and gradients every method has are left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine


def build_model(name: str, device: str) -> nn.Module:
    """A litgpt model by config name (random weights: no download)."""
    from litgpt import GPT, Config

    return GPT(Config.from_name(name)).to(device)


def set_grads(model: nn.Module, seed: int) -> None:
    """Fixed random gradients (the same for every method)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device, p.dtype)


def sync(device: str) -> None:
    """Wait for queued GPU work, so the clock measures it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_state_bytes(engine: ScapeEngine) -> int:
    """Bytes of SCAPE state beyond the parameters and gradients."""
    total = 0
    for i, bs in enumerate(engine.buckets):
        tensors = [bs.residual, bs.momentum, bs.last_sent, bs.values, bs.updated]
        tensors += [t for t in (bs.received, bs.gathered) if t is not None]
        tensors += list({id(m): m.indices for m in engine.masks.queues[i]}.values())
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pythia-14m", help="litgpt config name")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is over these)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per method per round")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    methods: dict[str, Callable[[], None]] = {}
    memory: dict[str, float] = {}
    numel = 0

    def add_torch(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        set_grads(model, 0)
        opt.step()  # allocate state outside the clock
        methods[name] = opt.step
        state = sum(
            t.numel() * t.element_size()
            for s in opt.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        memory[name] = state / sum(p.numel() for p in model.parameters())

    m = build_model(args.model, args.device)
    numel = sum(p.numel() for p in m.parameters())
    add_torch("torch AdamW (foreach)", m, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True))
    m = build_model(args.model, args.device)
    add_torch("lightning_scape AdamS", m, AdamS(m.parameters(), lr=1e-4))
    for label, density in (("SCAPE d=0.1", 0.1), ("SCAPE d=0.01", 0.01)):
        m = build_model(args.model, args.device)
        engine = ScapeEngine(
            AdamS(m.parameters(), lr=1e-4),
            ScapeConfig(density=density, dense_warmup_steps=0),
            param_order=list(m.parameters()),
        )
        set_grads(m, 0)
        engine.step()
        methods[label] = engine.step
        memory[label] = engine_state_bytes(engine) / engine.numel

    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(args.rounds):
        for name, step in methods.items():
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync(args.device)
            times[name].append((time.perf_counter() - t0) / args.steps)

    base = statistics.median(times["torch AdamW (foreach)"])
    print(
        f"model {args.model}: {numel / 1e6:.2f}M parameters, device {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps, medians"
    )
    print(f"{'method':<24} {'step ms':>9} {'min ms':>9} {'max ms':>9} {'vs AdamW':>9} {'state B/param':>14}")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(
            {
                "method": name,
                "median_s": med,
                "min_s": min(ts),
                "max_s": max(ts),
                "ratio_vs_adamw": med / base,
                "state_bytes_per_param": memory[name],
            }
        )
        print(
            f"{name:<24} {med * 1e3:9.2f} {min(ts) * 1e3:9.2f} {max(ts) * 1e3:9.2f} {med / base:9.2f} "
            f"{memory[name]:14.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "numel": numel, "device": args.device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
