"""The tiny litgpt GPT the multi-process strategy tests train (``test_fsdp_strategy``, ``test_lifecycle``): the
model, its batches, its loss, and its LightningModule."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_scape import AdamS

LR = 1e-2
# About 7.3k parameters without biases. A vocabulary of 65 rows does not divide by 2: lm_head and wte are padded
# by one row on the second of two shards.
GPT_CONFIG = {
    "n_layer": 2,
    "n_embd": 16,
    "n_head": 2,
    "vocab_size": 65,
    "padded_vocab_size": 65,
    "block_size": 8,
    "bias": False,
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "LLaMAMLP",
    "intermediate_size": 32,
}


def tiny_gpt() -> nn.Module:
    """The same tiny GPT on every process and in every run."""
    from litgpt.model import GPT, Config

    torch.manual_seed(0)
    return GPT(Config(**GPT_CONFIG))


def tokens(rank: int, step: int, micro: int = 0) -> Tensor:
    """Rank-, step- and micro-batch-specific token ids ``(2, 8)``."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randint(0, GPT_CONFIG["vocab_size"], (2, 8), generator=g)


def lm_loss(model: Any, x: Tensor) -> Tensor:
    """Next-token cross entropy."""
    logits = model(x)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


def full_params(model: nn.Module) -> Tensor:
    """The whole model's parameters as one fp64 vector (an FSDP model's all-gathered from its shards)."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1).double() for p in parts])


class LitGPT(L.LightningModule):
    """The tiny GPT as a LightningModule: the model in a submodule, AdamS from ``configure_optimizers``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt()

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return lm_loss(self.model, batch[0])

    def configure_optimizers(self) -> Any:
        return AdamS(self.parameters(), lr=LR)


class RankBatches(torch.utils.data.Dataset[Tensor]):
    """Rank ``rank``'s batches in the Fabric runs' order: item k is micro-batch ``k % accumulate`` of step
    ``k // accumulate`` (the Trainer runs with ``use_distributed_sampler=False``)."""

    def __init__(self, steps: int, rank: int, accumulate: int = 1) -> None:
        self.steps, self.rank, self.accumulate = steps, rank, accumulate

    def __len__(self) -> int:
        return self.steps * self.accumulate

    def __getitem__(self, k: int) -> Tensor:
        return tokens(self.rank, k // self.accumulate, k % self.accumulate)


def reference_adams(
    world_size: int, steps: int, accumulate: int = 1, max_norm: float | None = None, norms: list[float] | None = None
) -> list[Tensor]:
    """Data-parallel AdamS over ``world_size`` ranks' batches in one process, the gradient clipped to global norm
    ``max_norm`` (None: not clipped): the parameters (fp64) after each step; ``norms`` (when given) receives each
    step's global gradient norm before clipping."""
    model = tiny_gpt()
    opt = AdamS(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world_size):
            for micro in range(accumulate):
                model.zero_grad()
                lm_loss(model, tokens(rank, step, micro)).backward()
                for g, p in zip(grads, model.parameters(), strict=True):
                    g += p.grad / (world_size * accumulate)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        if norms is not None:
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]))
    return out
