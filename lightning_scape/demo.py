"""The README demo: dense AdamS against SCAPE (d = 0.01) on real text, 2 CPU processes over gloo.

A small litgpt GPT (byte-level, about 0.86M parameters) trains on the source files of this Python
interpreter's standard library, a corpus every machine has without a download. Both runs use the same
seed, data order and learning rate; the dense one all-reduces every gradient (what DDP sends), the SCAPE
one sends 1% of the values after a short dense warm-up. The table reports bytes sent per step, the
compression ratio, tokens/s, and the final train and validation loss.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import socket
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_scape.adams import AdamS
from lightning_scape.comm import ProcessGroupCommunicator
from lightning_scape.config import ScapeConfig
from lightning_scape.engine import ScapeEngine


def stdlib_corpus(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in sorted (deterministic) order."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}; pass --text FILE with your own text")
    out = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            out += fh.read()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


@dataclass(frozen=True)
class DemoArgs:
    """What both runs share."""

    steps: int
    batch_size: int
    block_size: int
    lr: float
    warmup: int
    density: float
    text: str | None
    max_bytes: int


def build_demo_model(block_size: int) -> torch.nn.Module:
    """The demo's litgpt GPT: 4 layers, 128 wide, byte-level (0.86M parameters), seeded."""
    from litgpt import GPT, Config

    cfg = Config(
        name="scape-demo",
        block_size=block_size,
        vocab_size=256,
        padded_vocab_size=256,
        n_layer=4,
        n_head=4,
        n_embd=128,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=344,
    )
    torch.manual_seed(0)
    return GPT(cfg)


def load_tokens(args: DemoArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of ``args.text`` (or the stdlib corpus), split 90/10 into train and validation."""
    """Byte tokens of ``args.text`` (or the stdlib corpus), split 90/10 into train and validation."""
    if args.text:
        with open(args.text, "rb") as fh:
            data = fh.read(args.max_bytes)
    else:
        data = stdlib_corpus(args.max_bytes)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:]


def sample_batch(
    tokens: torch.Tensor, gen: torch.Generator, batch: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of ``block`` tokens and their next-token targets."""
    ix = torch.randint(len(tokens) - block - 1, (batch,), generator=gen)
    x = torch.stack([tokens[i : i + block] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + block] for i in ix])
    return x, y


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def demo_optimizer(model: torch.nn.Module, lr: float) -> AdamS:
    """AdamS with weight decay on matrices only (norms and biases in a no-decay group)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups: list[dict[str, Any]] = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return AdamS(groups, lr=lr)


def set_cosine_lr(optimizer: torch.optim.Optimizer, step: int, steps: int, peak: float) -> None:
    """20 steps of linear warm-up, then cosine decay to zero at ``steps``."""
    lr = peak * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
    for g in optimizer.param_groups:
        g["lr"] = lr


@torch.no_grad()
def validation_loss(model: torch.nn.Module, val: torch.Tensor, block: int, batches: int = 8) -> float:
    """Mean loss on ``batches`` fixed (seeded) batches of 16 validation windows."""
    gen = torch.Generator().manual_seed(99)
    return sum(float(lm_loss(model, *sample_batch(val, gen, 16, block))) for _ in range(batches)) / batches


def _worker(rank: int, world_size: int, port: int, args: DemoArgs, method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        train, val = load_tokens(args)
        model = build_demo_model(args.block_size)
        opt = demo_optimizer(model, args.lr)
        if method == "dense":
            # Dense data-parallel AdamS: one all-reduce of every gradient, every step (what DDP sends).
            cfg = ScapeConfig(sharded=False, dense_warmup_steps=args.steps + 1)
        else:
            cfg = ScapeConfig(density=args.density, dense_warmup_steps=args.warmup)
        engine = ScapeEngine(opt, cfg, ProcessGroupCommunicator(timeout_s=120), list(model.parameters()))
        gen = torch.Generator().manual_seed(1234 + rank)
        total_steps = args.steps
        sparse_bytes: list[int] = []
        losses: list[float] = []
        t0 = time.perf_counter()
        for step in range(total_steps):
            set_cosine_lr(opt, step, total_steps, args.lr)
            x, y = sample_batch(train, gen, args.batch_size, args.block_size)
            loss = lm_loss(model, x, y)
            loss.backward()
            engine.step(max_grad_norm=1.0)
            engine.zero_grad()
            losses.append(float(loss.detach()))
            if step >= args.warmup or method == "dense":
                sparse_bytes.append(engine.counters.step_sent_bytes)
            if rank == 0 and (step % 25 == 0 or step == total_steps - 1):
                print(
                    f"  [{method}] step {step:4d}/{total_steps}  loss {losses[-1]:.3f}  "
                    f"sent {engine.counters.step_sent_bytes / 1e3:9.1f} kB",
                    flush=True,
                )
        elapsed = time.perf_counter() - t0
        model.eval()
        val_loss = validation_loss(model, val, args.block_size)
        if rank == 0:
            result: dict[str, Any] = {
                "method": method,
                "steps": total_steps,
                "params": engine.numel,
                "padded_params": engine.padded_numel,
                "tokens_per_s": total_steps * args.batch_size * args.block_size * world_size / elapsed,
                "bytes_per_step": sum(sparse_bytes) / max(1, len(sparse_bytes)),
                "dense_equivalent_per_step": engine.counters.total_dense_equivalent / total_steps,
                "train_loss": sum(losses[-10:]) / 10,
                "val_loss": val_loss,
                "total_bytes": engine.counters.total_sent_bytes,
            }
            torch.save(result, os.path.join(out_dir, f"{method}.pt"))
        engine.close()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Parse the demo's arguments, run dense AdamS then SCAPE on 2 processes, print the table."""
    ap = argparse.ArgumentParser(prog="lightning-scape demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine schedule)")
    ap.add_argument("--warmup", type=int, default=30, help="SCAPE dense warm-up steps")
    ap.add_argument("--density", type=float, default=0.01, help="SCAPE density")
    ap.add_argument("--text", default=None, help="a text file to train on (default: the Python stdlib source)")
    ap.add_argument("--max-bytes", type=int, default=4_000_000, help="bytes of text to read")
    ns = ap.parse_args(argv)
    args = DemoArgs(ns.steps, ns.batch_size, ns.block_size, ns.lr, ns.warmup, ns.density, ns.text, ns.max_bytes)
    world_size = 2
    results = []
    with tempfile.TemporaryDirectory() as out:
        for method in ("dense", "scape"):
            print(
                f"{'dense AdamS (all-reduce)' if method == 'dense' else f'SCAPE d={args.density}'}: "
                f"{world_size} processes, gloo, CPU",
                flush=True,
            )
            mp.start_processes(
                _worker, args=(world_size, _free_port(), args, method, out), nprocs=world_size, start_method="spawn"
            )
            results.append(torch.load(os.path.join(out, f"{method}.pt")))
    dense = results[0]
    print()
    print(
        f"{'method':<14} {'steps':>6} {'tokens/s':>9} {'kB sent/step':>13} {'vs DDP':>8} "
        f"{'train loss':>11} {'val loss':>9}"
    )
    for r in results:
        ratio = r["dense_equivalent_per_step"] / max(1.0, r["bytes_per_step"])
        name = "dense AdamS" if r["method"] == "dense" else f"SCAPE d={args.density}"
        print(
            f"{name:<14} {r['steps']:>6} {r['tokens_per_s']:>9.0f} {r['bytes_per_step'] / 1e3:>13.1f} "
            f"{ratio:>7.1f}x {r['train_loss']:>11.3f} {r['val_loss']:>9.3f}"
        )
    print(
        f"\n{dense['params'] / 1e6:.2f}M parameters; SCAPE's kB/step counts its sparse steps after "
        f"{args.warmup} dense warm-up steps."
    )
    return results


if __name__ == "__main__":
    run_demo(sys.argv[1:])
