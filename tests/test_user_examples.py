"""A user's AdamW, with torch's default betas, trains under SCAPE as under DDP: two of Lightning's own examples.

Lightning's Fabric image-classifier example (its CNN, ``benchmarks.user_models.FabricExampleNet``) and its
Trainer transformer example (``lightning.pytorch.demos.Transformer``), ported to two CPU processes with data of
the original shapes (``benchmarks/user_models.py``), with ``torch.optim.AdamW(lr=1e-3)`` as a user writes it,
run once under Lightning's DDP and once under SCAPE at its defaults. AdamS as it stepped before its normaliser
was bias-corrected left both at chance (``docs/algorithm.md`` section 2). The curves, with more models, learning
rates and betas: ``benchmarks/adamw_conversion.py``.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import PYTHON, child_env, launcher_args, load_outputs, run_script, save_output, scenario
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks.user_models import FabricExampleNet, segment_digits, word_tokens
from lightning_scape import ScapeStrategy
from lightning_scape.examples.workloads import free_port
from lightning_scape.pytorch import ScapeStrategy as TrainerScapeStrategy

pytestmark = pytest.mark.dist

STEPS = 60  # optimizer steps of each run: all inside SCAPE's default dense warm-up and the ramp's dense steps
VOCAB = 2048  # the transformer's vocabulary (the example's 33,278 makes its output layer 16x dearer)


# ------------------------------------------------------------------------------ Fabric: the image classifier


def classify(fabric: Fabric) -> dict[str, float]:
    """The example's loop, cut at :data:`STEPS` steps (AdamW, lr 1e-3, batch 32 per process: the example's 64 over
    the two), and its test loop."""
    fabric.seed_everything(1)
    train = DataLoader(TensorDataset(*segment_digits(STEPS * 64, seed=0)), batch_size=32, shuffle=True)
    test = DataLoader(TensorDataset(*segment_digits(1000, seed=1)), batch_size=500)
    train, test = fabric.setup_dataloaders(train, test)
    model = FabricExampleNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model.train()
    for data, target in train:
        optimizer.zero_grad()
        fabric.backward(F.nll_loss(model(data), target))
        optimizer.step()
    model.eval()
    loss = correct = 0.0
    with torch.no_grad():
        for data, target in test:
            output = model(data)
            loss += float(F.nll_loss(output, target, reduction="sum"))
            correct += float((output.argmax(1) == target).sum())
    totals = fabric.all_reduce(torch.tensor([loss, correct]), reduce_op="sum")
    return {"loss": float(totals[0]) / 1000, "accuracy": float(totals[1]) / 1000}


@scenario("fabric_examples")
def classifier_under_ddp(outdir: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    save_output(outdir, "classifier_ddp", fabric.global_rank, classify(fabric))


@scenario("fabric_examples")
def classifier_under_scape(outdir: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ScapeStrategy())
    fabric.launch()
    save_output(outdir, "classifier_scape", fabric.global_rank, classify(fabric))


@pytest.fixture(scope="module")
def fabric_examples(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("fabric_examples"))
    torchrun = [
        os.path.join(os.path.dirname(PYTHON), "torchrun"),
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        *launcher_args("test_user_examples", "fabric_examples", out),
    ]
    proc = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return out


def test_fabric_image_classifier_with_default_adamw_learns_under_scape_as_under_ddp(fabric_examples: str) -> None:
    ddp = load_outputs(fabric_examples, "classifier_ddp")[0]
    scape = load_outputs(fabric_examples, "classifier_scape")[0]
    assert ddp["accuracy"] > 0.45, ddp  # the example learns under DDP (chance is 0.1)
    assert scape["accuracy"] > ddp["accuracy"] - 0.05, (scape, ddp)
    assert scape["loss"] < ddp["loss"] * 1.1, (scape, ddp)


# ------------------------------------------------------------------------------ Trainer: the transformer


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """35-word windows of the word-level prose stream and their next words, as the example's ``WikiText2``."""

    def __init__(self, stream: Tensor, block: int = 35) -> None:
        self.stream, self.block = stream, block

    def __len__(self) -> int:
        return len(self.stream) // self.block - 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.block
        return self.stream[start : start + self.block], self.stream[start + 1 : start + self.block + 1]


class TransformerExample(pl.LightningModule):
    """Lightning's ``LightningTransformer`` demo, with the AdamW a user configures and a validation loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.nll_loss(self.model(x, y), y.view(-1))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.nll_loss(self.model(x, y), y.view(-1)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def model_language(outdir: str, name: str, strategy: Any) -> None:
    pl.seed_everything(1)
    train_words, val_words = word_tokens(VOCAB)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=4, val_check_interval=STEPS)  # fmt: skip
    model = TransformerExample()
    trainer.fit(model, DataLoader(Windows(train_words), batch_size=8, shuffle=True),
                DataLoader(Windows(val_words), batch_size=8))  # fmt: skip
    save_output(outdir, name, trainer.global_rank, {"val_loss": float(trainer.callback_metrics["val_loss"])})


@scenario("trainer_examples")
def transformer_under_ddp(outdir: str) -> None:
    model_language(outdir, "transformer_ddp", "ddp")


@scenario("trainer_examples")
def transformer_under_scape(outdir: str) -> None:
    model_language(outdir, "transformer_scape", TrainerScapeStrategy())


@pytest.fixture(scope="module")
def trainer_examples(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("trainer_examples"))
    run_script(launcher_args("test_user_examples", "trainer_examples", out), timeout_s=400,
               env=child_env(MASTER_PORT=str(free_port())))  # fmt: skip
    return out


def test_trainer_transformer_with_default_adamw_learns_under_scape_as_under_ddp(trainer_examples: str) -> None:
    ddp = load_outputs(trainer_examples, "transformer_ddp")[0]["val_loss"]
    scape = load_outputs(trainer_examples, "transformer_scape")[0]["val_loss"]
    # At the start the loss is ln(2048) = 7.6; the example copies its decoder's input and DDP + AdamW gets there.
    assert ddp < 4.0, ddp
    assert scape < ddp * 1.1, (scape, ddp)
