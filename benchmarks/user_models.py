"""Models a Lightning user brings, with data every machine has: what ``benchmarks/adamw_conversion.py`` trains.

Four workloads, each a model, a batch sampler, a loss and a held-out evaluation:

- ``cnn``: the convolutional classifier of Lightning's Fabric image-classifier example
  (``examples/fabric/image_classifier``: two 3x3 convolutions, dropout, two linear layers, 1.2M parameters) on
  MNIST-shaped images (1 x 28 x 28, 10 classes) of :func:`segment_digits`;
- ``mlp``: a three-layer perceptron (784-512-256-10, ReLU) on the same images;
- ``transformer``: ``lightning.pytorch.demos.Transformer`` (Lightning's Trainer example: an encoder-decoder with
  a 33,278-word vocabulary, 13.6M parameters) on a word-level corpus built like its ``WikiText2`` from the English
  prose that ships with Python (:func:`word_tokens`);
- ``gpt``: the package's small litgpt GPT (0.86M parameters) on the byte-level Python standard library
  (``lightning_scape.examples.workloads``).

MNIST and WikiText2 are downloads; these stand-ins keep the examples' shapes and run without a network.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_scape.examples.workloads import build_model, corpus_tokens, lm_loss, prose_corpus, sample_batch

Batch = tuple[Tensor, Tensor]

# Seven-segment digits: which of the segments (a top, b top right, c bottom right, d bottom, e bottom left,
# f top left, g middle) each digit lights.
_SEGMENTS = ("abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg")


def _segment_templates(size: int = 28) -> Tensor:
    """``[10, size, size]`` clean digits, strokes 2.5 pixels wide in a 10 x 18 box at the centre."""
    yy, xx = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                            indexing="ij")  # fmt: skip
    left, right, top, middle, bottom, half = 9.0, 19.0, 5.0, 14.0, 23.0, 1.25

    def across(y: float) -> Tensor:
        return ((yy - y).abs() <= half) & (xx >= left) & (xx <= right)

    def down(x: float, y0: float, y1: float) -> Tensor:
        return ((xx - x).abs() <= half) & (yy >= y0) & (yy <= y1)

    seg = {
        "a": across(top),
        "g": across(middle),
        "d": across(bottom),
        "f": down(left, top, middle),
        "b": down(right, top, middle),
        "e": down(left, middle, bottom),
        "c": down(right, middle, bottom),
    }
    return torch.stack([torch.stack([seg[s] for s in lit]).any(0).float() for lit in _SEGMENTS])


def segment_digits(n: int, seed: int, noise: float = 0.5) -> Batch:
    """``n`` MNIST-shaped images of seven-segment digits and their labels, a function of ``seed``.

    Each digit is rotated (up to 20 degrees), scaled (0.75-1.25), sheared and shifted at random; a fifth of its
    stroke pixels are dropped, it is blurred, Gaussian noise of standard deviation ``noise`` is added, and the
    set is normalised to mean 0 and standard deviation 1 (as the example's ``Normalize`` does for MNIST). The
    noise keeps a small classifier below 100% for a few hundred steps, so optimizers can be told apart.

    Returns:
        ``[n, 1, 28, 28]`` float images and ``[n]`` int64 labels.
    """
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=gen)
    clean = _segment_templates()[labels].unsqueeze(1)
    angle = (torch.rand(n, generator=gen) - 0.5) * math.radians(40)
    scale = 0.75 + 0.5 * torch.rand(n, generator=gen)
    shear = (torch.rand(n, generator=gen) - 0.5) * 0.6
    shift = (torch.rand(n, 2, generator=gen) - 0.5) * 0.4
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, shear - sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(clean.shape), align_corners=False)
    images = F.grid_sample(clean, grid, align_corners=False)
    images = images * (torch.rand(images.shape, generator=gen) > 0.2)
    images = F.avg_pool2d(F.pad(images, (1, 1, 1, 1), mode="replicate"), 3, 1)
    images = images + noise * torch.randn(images.shape, generator=gen)
    return (images - images.mean()) / images.std(), labels


class FabricExampleNet(nn.Module):
    """The network of Lightning's Fabric image-classifier example, as it is there (log-probabilities out)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return F.log_softmax(self.fc2(self.dropout2(x)), dim=1)


def mlp_classifier() -> nn.Module:
    """784-512-256-10 with ReLU, log-probabilities out."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 10), nn.LogSoftmax(dim=1))  # fmt: skip


@cache
def word_tokens(vocab_size: int = 33278) -> tuple[Tensor, Tensor]:
    """Word-level (train, validation) token streams of the prose corpus, tokenized as Lightning's ``WikiText2``.

    Every line is split on whitespace and ends with ``<eos>``, files in sorted order; the ``vocab_size - 1`` most
    frequent words keep an id, the rest share id 0 (``<unk>``). The last 5% of the stream is the validation split.
    """
    words: list[str] = []
    for path in sorted(prose_corpus().rglob("*.txt")):
        for line in path.read_text(encoding="utf-8").splitlines():
            words += [*line.split(), "<eos>"]
    ids = {w: i + 1 for i, (w, _) in enumerate(Counter(words).most_common(vocab_size - 1))}
    stream = torch.tensor([ids.get(w, 0) for w in words], dtype=torch.int64)
    cut = int(len(stream) * 0.95)
    return stream[:cut], stream[cut:]


def _windows(stream: Tensor, gen: torch.Generator, batch: int, length: int) -> Batch:
    """``batch`` random windows of ``length`` tokens and their next tokens."""
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen).tolist()
    x = torch.stack([stream[s : s + length] for s in starts])
    y = torch.stack([stream[s + 1 : s + length + 1] for s in starts])
    return x, y


@dataclass(frozen=True)
class Workload:
    """A model, its batches, its loss and its held-out evaluation.

    Args:
        name: The workload's name.
        build: The model from a seed.
        sample: A training batch of ``batch`` examples drawn with a generator.
        loss: The training loss of a batch (the model in train mode).
        evaluate: Held-out loss and, for classifiers, accuracy (the model in eval mode, no gradients).
        batch: Examples per step, over all ranks (the example's batch size).
    """

    name: str
    build: Callable[[int], nn.Module]
    sample: Callable[[torch.Generator, int], Batch]
    loss: Callable[[nn.Module, Batch], Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]
    batch: int


@cache
def _digits() -> tuple[Batch, Batch]:
    return segment_digits(12800, seed=0), segment_digits(2000, seed=1)


def _classifier_loss(model: nn.Module, batch: Batch) -> Tensor:
    return F.nll_loss(model(batch[0]), batch[1])


@torch.no_grad()
def _classifier_eval(model: nn.Module) -> dict[str, float]:
    x, y = _digits()[1]
    out = model(x)
    return {"loss": float(F.nll_loss(out, y)), "accuracy": float((out.argmax(1) == y).float().mean())}


def _digit_batch(gen: torch.Generator, batch: int) -> Batch:
    x, y = _digits()[0]
    i = torch.randint(0, len(y), (batch,), generator=gen)
    return x[i], y[i]


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return factory()

    return build


def _transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=33278)


def _transformer_loss(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return F.nll_loss(model(x, y), y.reshape(-1))


@torch.no_grad()
def _transformer_eval(model: nn.Module) -> dict[str, float]:
    gen = torch.Generator().manual_seed(99)
    val = word_tokens()[1]
    losses = [_transformer_loss(model, _windows(val, gen, 20, 35)) for _ in range(8)]
    return {"loss": float(torch.stack(losses).mean())}


GPT_BLOCK = 128


@cache
def _bytes() -> tuple[Tensor, Tensor]:
    return corpus_tokens("stdlib")


@torch.no_grad()
def _gpt_eval(model: nn.Module) -> dict[str, float]:
    from lightning_scape.examples.workloads import validation_loss

    return {"loss": validation_loss(model, _bytes()[1], GPT_BLOCK, batches=8)}


WORKLOADS: dict[str, Workload] = {
    "cnn": Workload("cnn", _seeded(FabricExampleNet), _digit_batch, _classifier_loss, _classifier_eval, 64),
    "mlp": Workload("mlp", _seeded(mlp_classifier), _digit_batch, _classifier_loss, _classifier_eval, 64),
    "transformer": Workload(
        "transformer",
        _seeded(_transformer),
        lambda gen, batch: _windows(word_tokens()[0], gen, batch, 35),
        _transformer_loss,
        _transformer_eval,
        20,
    ),
    "gpt": Workload(
        "gpt",
        lambda seed: build_model(GPT_BLOCK, preset="small", seed=seed),
        lambda gen, batch: sample_batch(_bytes()[0], gen, batch, GPT_BLOCK),
        lambda model, batch: lm_loss(model, *batch),
        _gpt_eval,
        16,
    ),
}
