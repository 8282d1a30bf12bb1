"""The small training workloads that the demo and the benchmarks share: models, corpora, loss and schedule.

``lightning-scape demo``, ``benchmarks/quality.py`` and the network benchmark (``benchmarks/network``) train
the same kind of model on the same kind of text, and compare runs that must differ only in how gradients
travel. Everything they have in common lives here, so that a number from one of them can be set beside a
number from another:

- the model: a small byte-level litgpt GPT (:func:`build_model`) in one of the :data:`MODEL_PRESETS`
  (``"small"``, 0.86M parameters, is the demo's);
- the optimizer: :class:`~lightning_scape.adams.AdamS` with weight decay on matrices only
  (:func:`weight_decay_groups`, :func:`adams_optimizer`);
- the data: two corpora every machine has without a download, read through
  :class:`~lightning_scape.litgpt.data.TextFolder` (:func:`corpus_tokens`): ``"stdlib"``, the ``.py`` sources of the
  running interpreter's standard library (code), and ``"prose"``, the English documentation that ships with
  Python (:func:`prose_corpus`); their sizes are in ``docs/benchmarks.md`` (Quality);
- the training step's pieces: random-window batches (:func:`sample_batch`), next-token loss (:func:`lm_loss`),
  a cosine learning rate with linear warm-up (:func:`set_cosine_lr`), validation on fixed batches
  (:func:`validation_loss`, :func:`validation_batch_losses`);
- :func:`free_port`, for starting a local process group.

These are small workloads for comparing optimizers and communication on a CPU in minutes, not a training
recipe: for real pretraining use ``lightning-scape pretrain`` (``docs/litgpt.md``).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

import torch

from lightning_scape.adams import AdamS
from lightning_scape.litgpt.data import STDLIB_EXCLUDED_DIRS, TextFolder, default_cache_dir, stdlib_root

# litgpt GPT shapes for byte-level models (vocabulary 256; the rotary embedding adds no parameters, so the
# counts do not depend on the block size).
MODEL_PRESETS: Mapping[str, Mapping[str, int]] = MappingProxyType(
    {
        # 2 layers, 64 wide: 131,904 parameters (0.13M), for smoke tests.
        "tiny": MappingProxyType({"n_layer": 2, "n_head": 2, "n_embd": 64, "intermediate_size": 172}),
        # 4 layers, 128 wide: 857,216 parameters (0.86M), the demo's and benchmarks/quality.py's model.
        "small": MappingProxyType({"n_layer": 4, "n_head": 4, "n_embd": 128, "intermediate_size": 344}),
        # 6 layers, 256 wide: 4.88M parameters (19.5 MB fp32), the network benchmark's W = 2 model.
        "base": MappingProxyType({"n_layer": 6, "n_head": 4, "n_embd": 256, "intermediate_size": 688}),
    }
)
BYTE_VOCAB_SIZE = 256

CorpusName = Literal["stdlib", "prose"]
CORPORA: tuple[str, ...] = get_args(CorpusName)
# Bump when the prose corpus's files or their content rules change: a new folder is then built beside the old.
PROSE_FORMAT_VERSION = 1
# Written last into a finished prose folder. Its name starts with "." so that TextFolder does not read it.
PROSE_MANIFEST = ".manifest.json"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


# ------------------------------------------------------------------------------------------------ the model


# The seed goes into torch's global generator, which threads share: simulated ranks that build at once would each
# draw an interleaved part of one stream and start from different weights.
_INIT_LOCK = threading.Lock()


def build_model(
    block_size: int, vocab_size: int = BYTE_VOCAB_SIZE, preset: str = "small", seed: int = 0
) -> torch.nn.Module:
    """A small litgpt GPT (Llama-style: RMSNorm, SwiGLU, full rotary, no biases), initialised from ``seed``.

    Args:
        block_size: The longest sequence the model sees.
        vocab_size: Token ids are below this (256 for bytes; the BPE vocabulary size otherwise).
        preset: A key of :data:`MODEL_PRESETS`: ``"tiny"``, ``"small"`` (the demo's) or ``"base"``.
        seed: The initialisation seed: every rank that builds from the same seed gets the same model, the
            simulated ranks of :func:`~lightning_scape.simulate` (threads) included.

    Returns:
        The model, initialised after ``torch.manual_seed(seed)`` (which also reseeds torch's global generator).

    Raises:
        ValueError: ``preset`` is not a key of :data:`MODEL_PRESETS`.
    """
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {list(MODEL_PRESETS)}.")
    from litgpt import GPT, Config  # litgpt is an optional dependency: the `litgpt` extra

    cfg = Config(
        name=f"scape-{preset}",
        block_size=block_size,
        vocab_size=vocab_size,
        padded_vocab_size=vocab_size,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        **MODEL_PRESETS[preset],
    )
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return GPT(cfg)


def weight_decay_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups: matrices (decayed) and vectors (norms and biases, ``weight_decay=0``)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def adams_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.1) -> AdamS:
    """AdamS with ``weight_decay`` on the matrices and none on the vectors (see :func:`weight_decay_groups`)."""
    return AdamS(weight_decay_groups(model), lr=lr, weight_decay=weight_decay)


def lm_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model(x)`` against targets ``y``, in nats per token."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


# ------------------------------------------------------------------------------------------ the training step


def sample_batch(
    tokens: torch.Tensor, gen: torch.Generator, batch: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``block`` tokens at random offsets drawn from ``gen``, and their next-token targets.

    Args:
        tokens: A 1-D token stream longer than ``block + 1``.
        gen: The generator of the offsets: one per rank, seeded, fixes the data order.
        batch: How many windows.
        block: Tokens per window.

    Returns:
        ``(x, y)``, each ``batch x block``, with ``y`` the tokens one position after ``x``'s.
    """
    ix = torch.randint(len(tokens) - block - 1, (batch,), generator=gen)
    x = torch.stack([tokens[i : i + block] for i in ix])
    y = torch.stack([tokens[i + 1 : i + 1 + block] for i in ix])
    return x, y


def cosine_lr(step: int, steps: int, peak: float, warmup_steps: int = 20) -> float:
    """The learning rate at ``step`` (from 0): a linear ramp over ``warmup_steps`` times a cosine from 1 to 0.

    The cosine runs over the whole run (it does not wait for the ramp to end): ``peak / warmup_steps`` at
    step 0, close to ``peak`` at the end of the ramp, and 0 at ``step == steps``.
    """
    return peak * min(1.0, (step + 1) / warmup_steps) * 0.5 * (1 + math.cos(math.pi * step / steps))


def set_cosine_lr(optimizer: torch.optim.Optimizer, step: int, steps: int, peak: float, warmup_steps: int = 20) -> None:
    """Set every parameter group's learning rate to :func:`cosine_lr` at ``step``."""
    lr = cosine_lr(step, steps, peak, warmup_steps)
    for g in optimizer.param_groups:
        g["lr"] = lr


@torch.no_grad()
def validation_batch_losses(
    model: torch.nn.Module, val: torch.Tensor, block: int, batches: int = 8, rank: int = 0, world_size: int = 1
) -> torch.Tensor:
    """The loss of each of ``batches`` fixed (seeded) batches of 16 validation windows.

    Args:
        model: The model to evaluate.
        val: Validation tokens.
        block: Tokens per window.
        batches: How many batches.
        rank: This process's rank; it evaluates batches ``rank``, ``rank + world_size``, ...
        world_size: How many processes share the batches.

    Returns:
        A float64 vector with this rank's batch losses and zeros elsewhere: summed over the ranks (adding
        zeros is exact), it equals the vector one process would compute alone.
    """
    gen = torch.Generator().manual_seed(99)
    out = torch.zeros(batches, dtype=torch.float64)
    for i in range(batches):
        x, y = sample_batch(val, gen, 16, block)  # every rank draws every batch: the same windows in any split
        if i % world_size == rank:
            out[i] = float(lm_loss(model, x, y))
    return out


def validation_loss(model: torch.nn.Module, val: torch.Tensor, block: int, batches: int = 8) -> float:
    """Mean loss on ``batches`` fixed (seeded) batches of 16 validation windows (one process)."""
    return sum(validation_batch_losses(model, val, block, batches).tolist()) / batches


# ------------------------------------------------------------------------------------------------ the corpora


def corpus_tokens(
    name: CorpusName, max_bytes: int | None = None, cache_dir: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte-level (train, validation) tokens of a named corpus, read and split by :class:`TextFolder`.

    The split is TextFolder's: whole files go to validation by a hash of their path (about 5% of them), each
    file ends with the end-of-text byte 0xFF, and the token arrays are cached on disk.

    Args:
        name: ``"stdlib"``: the ``.py`` sources of this interpreter's standard library (code).
            ``"prose"``: the English documentation that ships with Python (see :func:`prose_corpus`).
        max_bytes: Read at most this many bytes, files in sorted order; None reads everything.
        cache_dir: Where TextFolder caches the tokens (and where the prose corpus is written). Default
            ``$LIGHTNING_SCAPE_CACHE``, else ``~/.cache/lightning_scape/text``.

    Returns:
        The train and validation token streams, 1-D int64 tensors of byte values (0-255).

    Raises:
        ValueError: ``name`` is not one of :data:`CORPORA`, or ``max_bytes`` is not a positive number.
    """
    if name == "stdlib":
        path = None
    elif name == "prose":
        path = prose_corpus(cache_dir)
    else:
        raise ValueError(
            f"unknown corpus {name!r}; choose one of {list(CORPORA)}, or read your own text with "
            "lightning_scape.litgpt.data.TextFolder(path=...).token_splits()."
        )
    return TextFolder(path, tokenizer="byte", max_bytes=max_bytes, cache_dir=cache_dir).token_splits()


def prose_corpus(cache_dir: Path | None = None) -> Path:
    """A folder of English prose that ships with Python, written once into the cache and reused.

    It holds one ``topics/NAME.txt`` per entry of ``pydoc_data.topics.topics`` (the language reference
    sections that ``help()`` shows) and one ``modules/DOTTED.NAME.txt`` per standard-library module with
    docstrings, holding its module, class and function docstrings (``ast.get_docstring``) in source order,
    separated by blank lines. ``site-packages`` and the ``test``/``tests``/``idle_test`` folders are left out,
    and so are files that do not parse. That makes hundreds of files, enough for TextFolder's file-level
    split (the corpus's size is in ``docs/benchmarks.md``, Quality).

    The content is a function of the interpreter alone, so two builds give identical files. The folder is
    named by the format version and a hash of the interpreter's version and standard-library path; it is
    built when missing, in a temporary folder renamed into place, so processes building it at once are safe.

    Args:
        cache_dir: The parent of the ``corpora`` folder. Default ``$LIGHTNING_SCAPE_CACHE``, else
            ``~/.cache/lightning_scape/text``.

    Returns:
        The folder, ready for ``TextFolder(path=...)``.
    """
    root = stdlib_root()
    key = json.dumps([PROSE_FORMAT_VERSION, sys.version, str(root)])
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    parent = (cache_dir if cache_dir is not None else default_cache_dir()) / "corpora"
    folder = parent / f"prose-v{PROSE_FORMAT_VERSION}-{digest}"
    if (folder / PROSE_MANIFEST).is_file():
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        # Finished folders appear by rename with their manifest, so this one was damaged by hand: move it
        # aside atomically (a concurrent reader never sees it half-deleted), then rebuild.
        with contextlib.suppress(OSError):
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale.", dir=parent))
            os.replace(folder, aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=parent))
    try:
        files = n_bytes = 0
        for rel, text in _prose_documents(root):
            data = text.encode("utf-8", "replace")  # "replace": a lone surrogate in a docstring becomes "?"
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
            files, n_bytes = files + 1, n_bytes + len(data)
        manifest = {"format": PROSE_FORMAT_VERSION, "python": sys.version, "files": files, "bytes": n_bytes}
        (tmp / PROSE_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process renamed its (identical) folder into place first; keep that one.
            if not (folder / PROSE_MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _prose_documents(root: Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) of every prose file, in a fixed order: the topics, then the modules, sorted."""
    from pydoc_data.topics import topics

    for topic in sorted(topics):
        yield f"topics/{_SAFE_NAME.sub('_', topic)}.txt", topics[topic].strip() + "\n"
    for path in _stdlib_sources(root):
        docs = _docstrings(path)
        if docs:
            yield f"modules/{_SAFE_NAME.sub('_', _module_name(path, root))}.txt", "\n\n".join(docs) + "\n"


def _stdlib_sources(root: Path) -> Iterator[Path]:
    """The standard library's ``.py`` files in sorted order, without installed packages and test suites."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in STDLIB_EXCLUDED_DIRS)
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("."):
                yield Path(folder) / name


def _module_name(path: Path, root: Path) -> str:
    """``json/decoder.py`` -> ``json.decoder``; a package's ``__init__.py`` is named by the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if len(parts) > 1 and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _docstrings(path: Path) -> list[str]:
    """The module's, its classes' and its functions' docstrings in source order; [] when it does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarnings of old escape sequences: the docstring still reads
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):  # unreadable, not Python 3, or a NUL byte in the source
        return []
    docs: list[str] = []
    stack: list[ast.AST] = [tree]
    while stack:  # depth first in source order (ast.walk is breadth first)
        node = stack.pop()
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and doc.strip():
                docs.append(doc.strip())
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return docs


# ------------------------------------------------------------------------------------------- process groups


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now, for ``MASTER_PORT``.

    Another process may take it before the caller binds it; local launchers take a fresh port per group
    rather than reusing one a previous group may still hold in ``TIME_WAIT``.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
