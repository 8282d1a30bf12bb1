"""Per-rank model-state memory: ``ScapeFSDPStrategy`` against ``ScapeStrategy`` and FSDP's native HSDP.

Model state is what a rank keeps between steps: parameters, gradients, SCAPE's residual and momentum (and its
small extras: last-sent steps and compact buffers), or the optimizer state. Activations and FSDP's transient
all-gather buffers are not counted.

Measured: ``python -m benchmarks.fsdp_memory`` starts 4 gloo processes on the CPU (2 groups x shard_size 2), builds
each form on a small litgpt GPT, takes one step so that every buffer exists, and adds up the bytes of the distinct
storages each rank holds, by kind. The same script prints the formula for 1B to 70B parameters (fp32 parameters,
as with ``"32-true"`` and ``"bf16-mixed"``), checked against the measurement on the small model.

    python -m benchmarks.fsdp_memory            # measure (about 20 s) and print both tables
    python -m benchmarks.fsdp_memory --formula  # the formula table only
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

W, S = 4, 2
KINDS = ("params", "grads", "residual", "momentum", "extras")
SMALL_GPT = {
    "n_layer": 4,
    "n_embd": 128,
    "n_head": 4,
    "vocab_size": 512,
    "padded_vocab_size": 512,
    "block_size": 64,
    "bias": False,
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "LLaMAMLP",
    "intermediate_size": 384,
}


# ----------------------------------------------------------------------------------------- the formula


@dataclass(frozen=True)
class Layout:
    """W processes in R = W / S groups of S."""

    world_size: int
    shard_size: int

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size


def formula_bytes(form: str, n: float, layout: Layout, param_bytes: int = 4) -> dict[str, float]:
    """Per-rank bytes of each kind for ``n`` parameters (SCAPE's extras left out: a few percent at most).

    ``scape``: ``ScapeStrategy`` (whole model on every rank, momentum sharded W ways); ``scape_fsdp``: parameters,
    gradients and residual sharded S ways, momentum W ways; ``hsdp_adams`` / ``hsdp_adamw``: FSDP's HSDP
    (parameters, gradients and optimizer state sharded S ways, replicated across the R groups) with AdamS's one
    moment or AdamW's two. The residual and momentum are fp32.
    """
    Wn, Sn = layout.world_size, layout.shard_size
    if form == "scape":
        return {"params": n * param_bytes, "grads": n * param_bytes, "residual": 4 * n, "momentum": 4 * n / Wn}
    if form == "scape_fsdp":
        shard = n / Sn
        return {
            "params": shard * param_bytes,
            "grads": shard * param_bytes,
            "residual": 4 * shard,
            "momentum": 4 * n / Wn,
        }
    moments = {"hsdp_adams": 1, "hsdp_adamw": 2}[form]
    shard = n / Sn
    return {
        "params": shard * param_bytes,
        "grads": shard * param_bytes,
        "residual": 0.0,
        "momentum": 4 * moments * shard,
    }


FORMS = ("scape", "scape_fsdp", "hsdp_adams", "hsdp_adamw")
NAMES = {
    "scape": "ScapeStrategy",
    "scape_fsdp": "ScapeFSDPStrategy",
    "hsdp_adams": "HSDP + AdamS",
    "hsdp_adamw": "HSDP + AdamW",
}


def formula_table(sizes: Iterable[float], layouts: Iterable[Layout]) -> str:
    """Markdown: per-rank GB of model state by model size, form and layout (fp32 parameters)."""
    lines = [
        "| parameters | W | S | " + " | ".join(NAMES[f] for f in FORMS) + " | ScapeFSDP / ScapeStrategy x S |",
        "|---|---|---|" + "---|" * len(FORMS) + "---|",
    ]
    for n in sizes:
        for layout in layouts:
            totals = {f: sum(formula_bytes(f, n, layout).values()) for f in FORMS}
            cells = " | ".join(f"{totals[f] / 1e9:.1f}" for f in FORMS)
            ratio = totals["scape_fsdp"] / totals["scape"] * layout.shard_size
            lines.append(f"| {n / 1e9:g}B | {layout.world_size} | {layout.shard_size} | {cells} | {ratio:.3f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the measurement


class _Storages:
    """Bytes by kind, each storage counted once (the first kind that names it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, tensors: Iterable[Tensor | None]) -> None:
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(storage.data_ptr())
            self.bytes[kind] += storage.nbytes()


def _local(t: Tensor | None) -> Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _engine_storages(engine: Any, model: nn.Module) -> dict[str, int]:
    """A SCAPE form's per-rank bytes: the model's parameters and gradients, then the engine's own state."""
    found = _Storages()
    with torch.no_grad():
        found.add("params", (_local(p) for p in model.parameters()))
        found.add("params", (bs.params for bs in engine.buckets))
        found.add("grads", (_local(p.grad) for p in model.parameters()))
        found.add("grads", (bs.grads for bs in engine.buckets))
        found.add("residual", (bs.residual for bs in engine.buckets))
        found.add("momentum", (bs.momentum for bs in engine.buckets))
        extras = ("last_sent", "_values", "_received", "_updated", "_gathered", "dense_shard")
        found.add("extras", (getattr(bs, name) for bs in engine.buckets for name in extras))
    return found.bytes


def _small_gpt() -> nn.Module:
    from litgpt.model import GPT, Config

    torch.manual_seed(0)
    return GPT(Config(**SMALL_GPT))


def _one_step(model: nn.Module, step: Any) -> None:
    x = torch.randint(0, SMALL_GPT["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    logits = model(x)
    nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).backward()
    step()


def _measure_scape_fsdp() -> dict[str, int]:
    from lightning_scape import AdamS, ScapeConfig
    from lightning_scape.engine import fsdp_binding
    from lightning_scape.runtime import fsdp

    grid = fsdp_binding.shard_grid(W, S, S, dist.get_rank())
    mesh = fsdp_binding.build_mesh("cpu", grid)
    model = _small_gpt()
    fsdp_binding.shard_module(model, mesh["shard"], None)
    comm = fsdp_binding.replicate_communicator(mesh, grid, 120.0)
    config = ScapeConfig(density=0.01, dense_warmup_steps=0)
    opt, binding = fsdp.build_fsdp_scape_optimizer(AdamS(model.parameters()), config, model, comm)
    _one_step(model, opt.step)
    out = _engine_storages(opt.engine, model)
    opt.engine.close()
    binding.detach()
    return out


def _measure_scape() -> dict[str, int]:
    from lightning_scape import AdamS, ProcessGroupCommunicator, ScapeConfig, ScapeEngine

    model = _small_gpt()
    config = ScapeConfig(density=0.01, dense_warmup_steps=0)
    engine = ScapeEngine(AdamS(model.parameters()), config, ProcessGroupCommunicator(timeout_s=120.0))
    _one_step(model, engine.step)
    out = _engine_storages(engine, model)
    engine.close()
    return out


def _measure_hsdp(optimizer: str) -> dict[str, int]:
    from litgpt.model import Block
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_scape import AdamS

    mesh = init_device_mesh("cpu", (W // S, S), mesh_dim_names=("replicate", "shard"))
    model = _small_gpt()
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = AdamS(model.parameters()) if optimizer == "adams" else torch.optim.AdamW(model.parameters(), foreach=False)
    _one_step(model, opt.step)
    found = _Storages()
    found.add("params", (_local(p) for p in model.parameters()))
    found.add("grads", (_local(p.grad) for p in model.parameters()))
    states = [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    found.add("momentum", states)
    return found.bytes


def _worker(rank: int, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=W, timeout=timedelta(seconds=120))
    try:
        results = {
            "scape": _measure_scape(),
            "scape_fsdp": _measure_scape_fsdp(),
            "hsdp_adams": _measure_hsdp("adams"),
            "hsdp_adamw": _measure_hsdp("adamw"),
        }
        numel = sum(p.numel() for p in _small_gpt().parameters())
        queue.put((rank, numel, results))
    finally:
        dist.destroy_process_group()


def measure() -> tuple[int, list[dict[str, dict[str, int]]]]:
    """Every rank's bytes by form and kind on the small GPT (4 gloo processes); and its parameter count."""
    from lightning_scape.examples.workloads import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(W)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=300) for _ in range(W)]
    for p in procs:
        p.join(60)
    got.sort(key=lambda item: item[0])
    return got[0][1], [g[2] for g in got]


def measured_table(numel: int, ranks: list[dict[str, dict[str, int]]]) -> str:
    """Markdown: the largest rank's bytes by form and kind, and the formula's total beside them."""
    layout = Layout(W, S)
    lines = [
        "| form | " + " | ".join(KINDS) + " | total (KiB) | formula (KiB) | / ScapeStrategy |",
        "|---|" + "---|" * (len(KINDS) + 3),
    ]
    worst = {f: max(ranks, key=lambda r, f=f: sum(r[f].values()))[f] for f in FORMS}
    base = sum(worst["scape"].values())
    for f in FORMS:
        b = worst[f]
        total = sum(b.values())
        model = sum(formula_bytes(f, numel, layout).values())
        cells = " | ".join(f"{b[k] / 1024:.1f}" for k in KINDS)
        lines.append(f"| {NAMES[f]} | {cells} | {total / 1024:.1f} | {model / 1024:.1f} | {total / base:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formula", action="store_true", help="print the formula table only")
    args = parser.parse_args()
    if not args.formula:
        numel, ranks = measure()
        print(f"## Measured: small litgpt GPT ({numel:,} parameters), W = {W}, shard_size = {S}, fp32, CPU\n")
        print(measured_table(numel, ranks) + "\n")
    print("## Formula: per-rank GB of model state (fp32 parameters; SCAPE extras not included)\n")
    sizes = (1e9, 8e9, 13e9, 70e9)
    print(formula_table(sizes, (Layout(16, 8), Layout(32, 8), Layout(64, 8))))


if __name__ == "__main__":
    main()
