"""A litgpt data module for a folder of text files, tokenized and cached locally, with no download.

:class:`TextFolder` reads every UTF-8 text file under a folder (or one file; by default the ``.py`` sources
of the running interpreter's standard library), splits the files deterministically into train and
validation, tokenizes them with a byte-level tokenizer or a byte-level BPE trained on the train split, caches
the token arrays on disk and serves fixed windows of ``max_seq_length + 1`` tokens, the batches litgpt's
pretraining loop expects (inputs ``[:, :T]``, targets ``[:, 1:T + 1]``).

Use it from a recipe::

    data:
      class_path: lightning_scape.litgpt.data.TextFolder
      init_args:
        path: /data/my_corpus      # empty: the Python standard library's sources
        tokenizer: bpe
        vocab_size: 16384

Tokenizing the default corpus takes seconds, and loading it from the cache far less, so ``max_bytes``
defaults to no limit; the corpus's size and the timings are in ``docs/litgpt.md`` ("Data: TextFolder").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Dataset

# Bump when the cached files' layout or content rules change: old cache entries are then ignored.
FORMAT_VERSION = 1
# Byte-level documents end with 0xFF: it never occurs in UTF-8 text, so it is an unambiguous end-of-text
# token inside the 256-symbol vocabulary (split a decoded stream on it to get the files back exactly).
BYTE_EOT = 0xFF
# The BPE end-of-text special token; it is the first special token, so its id is 0 (< vocab_size).
BPE_EOT = "<|endoftext|>"
# Files whose first 8 kB hold a NUL byte are binary (git's heuristic); the rest must decode as UTF-8.
SNIFF_BYTES = 8192
# Folders left out of the standard-library corpus: installed packages are not the stdlib, and the test
# suites hold deliberately malformed sources and large generated data.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Text passed to the BPE encoder per call: encode_batch parallelizes over documents where the tokenizers
# build uses several threads, and the bound keeps the Python-side encodings it returns (objects far larger
# than their token ids) small; much larger batches are slower, not faster, from the allocation churn.
_ENCODE_BATCH_BYTES = 256_000

TokenizerKind = Literal["byte", "bpe"]


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_cache_dir() -> Path:
    """``$LIGHTNING_SCAPE_CACHE`` if set, else ``~/.cache/lightning_scape/text``."""
    env = os.environ.get("LIGHTNING_SCAPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_scape" / "text"


# ---------------------------------------------------------------------- corpus: listing, reading, splitting


@dataclass(frozen=True)
class _Source:
    """One candidate file: where it is, its split key and what identifies its content for the cache."""

    path: Path
    rel: str  # POSIX path relative to the corpus root: the stable key of the train/validation split
    size: int
    mtime_ns: int
    mode: int  # permission bits: a chmod that makes a skipped file readable changes no mtime


@dataclass
class _Corpus:
    """The listed files of a corpus and what was left out while listing."""

    root: Path
    sources: list[_Source]
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (path, error) of unreadable folders/files

    @classmethod
    def scan(cls, path: Path | None) -> _Corpus:
        """Every candidate file, sorted by relative path, with its size and modification time (no reading).

        Args:
            path: A folder (listed recursively) or one file; None: the standard library's ``.py`` sources.
        """
        stdlib = path is None
        if path is None:
            root = stdlib_root()
        elif path.is_file():
            resolved = path.resolve()
            st = resolved.stat()
            return cls(resolved.parent, [_Source(resolved, resolved.name, st.st_size, st.st_mtime_ns, st.st_mode)])
        else:
            root = path
        root = root.resolve()
        corpus = cls(root, [])

        def on_error(err: OSError) -> None:
            corpus.unlisted.append((str(err.filename), err.strerror or str(err)))

        for folder, dirs, files in os.walk(root, onerror=on_error):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (stdlib and d in STDLIB_EXCLUDED_DIRS))
            for name in files:
                if name.startswith(".") or (stdlib and not name.endswith(".py")):
                    continue
                file = Path(folder) / name
                try:
                    st = file.stat()
                except OSError as err:  # a dangling link, or a file that vanished since the listing
                    corpus.unlisted.append((str(file), err.strerror or str(err)))
                    continue
                if stat.S_ISREG(st.st_mode):  # FIFOs and devices would block or never end
                    rel = file.relative_to(root).as_posix()
                    corpus.sources.append(_Source(file, rel, st.st_size, st.st_mtime_ns, st.st_mode))
        corpus.sources.sort(key=lambda s: s.rel)
        return corpus


def _read_file(path: Path, limit: int) -> bytes:
    """Read ``limit`` bytes of ``path`` (all of it for -1). A function of its own so tests can replace it."""
    with open(path, "rb") as fh:
        return fh.read(limit)


def _split_fraction(rel: str) -> float:
    """A stable pseudo-random number in [0, 1) for a relative path: below ``val_fraction`` means validation.

    Hashing the path (not the content, not the position in the listing) keeps every file in its split when
    other files are added or removed, and when the file itself is edited.
    """
    digest = hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _char_boundary(data: bytes, pos: int) -> int:
    """The largest index <= ``pos`` that does not fall inside a UTF-8 multi-byte sequence."""
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


def _as_text(data: bytes, truncated: bool) -> bytes | None:
    """``data`` if it is UTF-8 text (a cut-off final character dropped when ``truncated``), else None."""
    if b"\x00" in data[:SNIFF_BYTES]:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        # Reading a prefix can cut a multi-byte character in two; that is not a binary file.
        if not (truncated and err.reason == "unexpected end of data" and err.start >= len(data) - 3):
            return None
        data = data[: err.start]
    return data


@dataclass
class _Reading:
    """What reading a corpus found: the text files, and what was skipped and why."""

    docs: list[tuple[str, bytes]] = field(default_factory=list)  # (relative path, text) in sorted order
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, error), the listing's included
    binary: int = 0
    empty: int = 0

    def stats(self) -> dict[str, Any]:
        """The skipped counts, as the cache's ``meta.json`` records them."""
        return {"skipped_binary": self.binary, "skipped_empty": self.empty, "skipped_unreadable": len(self.unreadable)}


def _read_texts(corpus: _Corpus, max_bytes: int | None) -> _Reading:
    """Read the corpus's files in sorted order, keeping the UTF-8 text ones, until ``max_bytes`` are read.

    Args:
        corpus: The listed files.
        max_bytes: Read at most this many bytes of text, the last file cut at a character boundary; None: all.
    """
    reading = _Reading(unreadable=list(corpus.unlisted))
    left = max_bytes
    for source in corpus.sources:
        if left is not None and left <= 0:
            break
        try:
            data = _read_file(source.path, -1 if left is None else left)
        except OSError as err:
            reading.unreadable.append((str(source.path), err.strerror or str(err)))
            continue
        text = _as_text(data, truncated=left is not None and len(data) == left)
        if text is None:
            reading.binary += 1
        elif not text:
            reading.empty += 1
        else:
            reading.docs.append((source.rel, text))
            if left is not None:
                left -= len(data)
    return reading


def _report_unreadable(reading: _Reading, where: str) -> None:
    """Warn about the unreadable files and folders, or refuse the corpus when nothing else was there.

    Raises:
        PermissionError: Every file is unreadable.
    """
    if not reading.unreadable:
        return
    names = ", ".join(f"{p} ({e})" for p, e in reading.unreadable[:5])
    more = f" and {len(reading.unreadable) - 5} more" if len(reading.unreadable) > 5 else ""
    if not reading.docs and reading.binary == 0 and reading.empty == 0:
        raise PermissionError(
            f"TextFolder: every file under {where} is unreadable, e.g. {names}{more}. "
            "Check the permissions, or point data.init_args.path elsewhere."
        )
    # stacklevel 3: past this helper and _read_documents, to the cache build that asked for the documents.
    warnings.warn(
        f"TextFolder: skipped {len(reading.unreadable)} unreadable file(s) or folder(s): {names}{more}", stacklevel=3
    )


def _read_documents(
    corpus: _Corpus, where: str, max_bytes: int | None
) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
    """The text files' bytes in sorted order, up to ``max_bytes``, and counts of what was skipped.

    Args:
        corpus: The listed files.
        where: The corpus as the error messages name it.
        max_bytes: Read at most this many bytes of text, the last file cut at a character boundary; None: all.

    Raises:
        ValueError: There are no files, or none of them is readable UTF-8 text.
        PermissionError: Every file is unreadable.
    """
    if not corpus.sources and not corpus.unlisted:
        raise ValueError(
            f"TextFolder: no files under {where} (hidden files and folders are skipped). "
            "Point data.init_args.path at a folder or file of text."
        )
    reading = _read_texts(corpus, max_bytes)
    _report_unreadable(reading, where)
    if not reading.docs:
        raise ValueError(
            f"TextFolder: no readable text files under {where}: {reading.binary} skipped as binary (a NUL byte in "
            f"the first {SNIFF_BYTES} bytes, or not UTF-8), {reading.empty} empty, {len(reading.unreadable)} "
            "unreadable. Point data.init_args.path at UTF-8 text."
        )
    return reading.docs, reading.stats()


def _split_documents(
    docs: list[tuple[str, bytes]], val_fraction: float
) -> tuple[list[tuple[bytes, bool]], list[tuple[bytes, bool]], str]:
    """(train pieces, val pieces, mode): pieces are (text, ends_a_document); mode is "files" or "stream"."""
    is_val = [_split_fraction(rel) < val_fraction for rel, _ in docs]
    if any(is_val) and not all(is_val):
        train = [(d, True) for (_, d), v in zip(docs, is_val, strict=True) if not v]
        val = [(d, True) for (_, d), v in zip(docs, is_val, strict=True) if v]
        return train, val, "files"
    # Too few files for a file-level split: cut the concatenated text, the last val_fraction is validation.
    # Cutting the text (not the tokens) keeps the BPE from ever seeing validation text.
    total = sum(len(d) for _, d in docs)
    cut = int(total * (1.0 - val_fraction))
    train_pieces: list[tuple[bytes, bool]] = []
    val_pieces: list[tuple[bytes, bool]] = []
    offset = 0
    for _, data in docs:
        if offset + len(data) <= cut:
            train_pieces.append((data, True))
        elif offset >= cut:
            val_pieces.append((data, True))
        else:
            k = _char_boundary(data, cut - offset)
            train_pieces.append((data[:k], False))
            val_pieces.append((data[k:], True))
        offset += len(data)
    return train_pieces, val_pieces, "stream"


def _check_corpus_path(path: Path) -> None:
    """``path`` must be an existing folder or regular file.

    Raises:
        FileNotFoundError: It does not exist.
        ValueError: It is something else (a FIFO, a device, ...).
    """
    if not path.exists():
        raise FileNotFoundError(
            f"TextFolder: path {str(path)!r} does not exist. Set data.init_args.path to a folder "
            "or file of text, or leave it empty for the Python standard library's sources."
        )
    if not (path.is_dir() or path.is_file()):
        raise ValueError(f"TextFolder: path {str(path)!r} is neither a folder nor a regular file.")


# ------------------------------------------------------------------------- token windows and the DataModule


class TokenWindows(Dataset[torch.Tensor]):
    """Fixed windows of ``seq_length + 1`` tokens from a 1-D token tensor, as int64.

    Window ``i`` starts at ``i * seq_length``: consecutive windows share one token, so every token but the
    first is a prediction target exactly once per epoch. A map-style dataset, so Fabric's
    ``setup_dataloaders`` can shard it with a ``DistributedSampler``.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        self.tokens = tokens
        self.seq_length = seq_length

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].long()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` whose position survives a checkpoint, for litgpt's pretraining loop.

    litgpt puts the train loader into the state it saves with ``fabric.save``; Fabric stores an object that has
    ``state_dict()`` / ``load_state_dict()`` as its state dict, and would otherwise pickle the whole loader (with
    its tokens) into a file that ``torch.load(weights_only=True)`` then refuses. The state is the epoch and the
    number of batches already handed out in it; a resumed loader re-seeds the shuffle for that epoch (through
    ``DistributedSampler.set_epoch`` under Fabric, or its own generator otherwise) and skips the batches that
    were consumed, so training continues on exactly the batches the uninterrupted run would have seen.

    Skipping draws the skipped batches' indices and loads their windows (a slice of an in-memory tensor each);
    the cost is one pass over part of an epoch, once per resume.
    """

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        epoch, skip = getattr(self, "_epoch", 0), getattr(self, "_skip", 0)
        self._skip, self._position = 0, skip
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)  # Fabric set it from its own count, which restarts at 0 on resume
        elif self.generator is not None:
            # A RandomSampler draws from this generator: seed it per epoch so the order is a function of the epoch.
            if not hasattr(self, "_base_seed"):
                self._base_seed = self.generator.initial_seed()
            self.generator.manual_seed(self._base_seed + epoch)
        iterator = super().__iter__()
        for _ in range(skip):
            next(iterator, None)
        for batch in iterator:
            self._position += 1
            yield batch
        self._epoch, self._position = epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """The epoch in progress and the batches of it handed out so far."""
        return {"epoch": getattr(self, "_epoch", 0), "position": getattr(self, "_position", 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at ``state``'s position: the next iteration skips the batches already consumed."""
        self._epoch, self._position, self._skip = int(state["epoch"]), int(state["position"]), int(state["position"])


@dataclass
class TextFolder(DataModule):
    """Pretraining data from a folder of text files, tokenized locally (byte-level or a BPE trained here).

    Files are read recursively in sorted order; hidden files and folders (names starting with ``.``) are
    skipped, and so is every file that is not UTF-8 text (a NUL byte in its first 8 kB, or a decoding
    error). Each file goes to validation when a hash of its relative path falls below ``val_fraction``, so
    the split is deterministic, disjoint at the file level, and adding a file never moves another one. When
    that leaves one split without files (a single file, or a handful), the concatenated text is split
    instead: its last ``val_fraction`` of bytes (moved back to a character boundary) is validation.
    Documents end with an end-of-text token (byte 0xFF, or ``<|endoftext|>`` for BPE).

    The token arrays (and the BPE ``tokenizer.json``) are cached under ``cache_dir``, keyed by the listed
    files and the settings (:class:`_TokenCache` says exactly what the key covers): a changed corpus or
    setting is re-tokenized, an unchanged one is loaded from the cache. Several ranks may build the same
    entry at once; each builds in a temporary folder and renames it into place, so a reader never sees a
    half-written entry. Old entries are not deleted; remove ``cache_dir`` to reclaim the space.

    The model's embedding must hold :attr:`vocab_size_bound` ids. litgpt's ``--tokenizer_dir`` must be
    unset: this module trains its own tokenizer (choose it with ``tokenizer``), and :meth:`connect` refuses
    a litgpt tokenizer rather than silently ignoring it.

    Args:
        path: A folder of text files (read recursively) or one text file. Empty (None): the ``.py`` files
            of this Python's standard library (:func:`stdlib_root`), leaving out ``site-packages`` and the
            ``test``/``tests``/``idle_test`` folders: real text every machine has (its size is in
            ``docs/litgpt.md``), enough for models of up to a few million parameters. Bring your own corpus
            for anything larger: the number of tokens should be at least ~20x the parameter count for the
            loss to mean much.
        tokenizer: "byte": the 256 byte values, nothing to train; the simplest choice for small models and
            tests, but sequences are several times longer than with BPE for the same text. "bpe": a
            byte-level BPE trained on the train split with the ``tokenizers`` package; use it for models of
            10M+ parameters, whose context then covers more text per token.
        vocab_size: BPE vocabulary size including the 256 byte symbols and ``<|endoftext|>`` (>= 257;
            ignored for "byte"). Larger vocabularies shorten the sequences but add ``vocab_size x n_embd``
            embedding parameters and need more text per id: 4096-8192 for corpora of ~10 MB, 16k-32k for
            hundreds of MB. Keep it <= the model's ``padded_vocab_size``.
        val_fraction: Expected fraction of the files held out for validation, in (0, 0.5]. It counts files,
            not bytes, so the byte share varies with the files' sizes. 0.05 suits hundreds to thousands of
            files; with tens of thousands 0.005-0.01 is plenty and keeps more for training. Raise it if the
            validation split is too small for one window of ``max_seq_length + 1`` tokens.
        max_bytes: Read at most this many bytes of text, files taken in sorted order and the last one cut
            (at a character boundary). None reads everything. Set it for quick runs and smoke tests
            (e.g. 1_000_000); the standard-library default needs no limit.
        cache_dir: Where the token arrays and the tokenizer are cached. Default ``$LIGHTNING_SCAPE_CACHE``,
            else ``~/.cache/lightning_scape/text``. On a multi-node run without a shared filesystem every
            node builds its own (identical) cache.
        seed: Seed of the train shuffling when no distributed sampler is used. Under Fabric/Trainer the
            ``DistributedSampler`` takes over, shuffling with the run's global seed.
        num_workers: DataLoader worker processes. 0 is right here: a batch is a slice of an in-memory
            (memory-mapped) tensor, far cheaper than a worker's inter-process transfer.
    """

    path: Path | None = None
    tokenizer: TokenizerKind = "byte"
    vocab_size: int = 4096
    val_fraction: float = 0.05
    max_bytes: int | None = None
    cache_dir: Path | None = None
    seed: int = 42
    num_workers: int = 0

    # Set by connect(): litgpt passes its micro-batch size and the model's block size.
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__init__()
        problems = self._setting_problems()
        if problems:
            raise ValueError("Invalid TextFolder: " + "; ".join(problems) + ".")
        if self.path is not None:
            # jsonargparse gives a Path; Python callers may pass a str.
            self.path = Path(self.path).expanduser()
            _check_corpus_path(self.path)
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir).expanduser()
        # The loaded splits, keyed by their cache entry so a changed corpus is never served stale.
        self._loaded: tuple[Path, torch.Tensor, torch.Tensor] | None = None

    def _setting_problems(self) -> list[str]:
        """What is wrong with the settings other than ``path``, each saying what to use; all of them at once."""
        problems: list[str] = []
        if self.tokenizer not in ("byte", "bpe"):
            problems.append(f"tokenizer={self.tokenizer!r} is unknown; use 'byte' or 'bpe'")
        if self.tokenizer == "bpe" and (not isinstance(self.vocab_size, int) or self.vocab_size < 257):
            problems.append(
                f"vocab_size={self.vocab_size!r} is too small for a BPE: it must be >= 257 "
                "(256 byte symbols plus <|endoftext|>); 4096 is a good start"
            )
        if not 0.0 < self.val_fraction <= 0.5:
            problems.append(f"val_fraction={self.val_fraction!r} must lie in (0, 0.5]; 0.05 holds out 5% of the files")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes < 1):
            problems.append(f"max_bytes={self.max_bytes!r} must be a positive number of bytes, or empty for no limit")
        if self.num_workers < 0:
            problems.append(f"num_workers={self.num_workers!r} must be >= 0")
        return problems

    # ------------------------------------------------------------------------------------------- public API

    @property
    def vocab_size_bound(self) -> int:
        """How many token ids the model's embedding must hold: 256 for "byte", ``vocab_size`` for "bpe"."""
        return 256 if self.tokenizer == "byte" else self.vocab_size

    @property
    def tokenizer_path(self) -> Path | None:
        """The cached ``tokenizer.json`` of the BPE (None for "byte"); it exists after :meth:`prepare_data`.

        Load it with ``tokenizers.Tokenizer.from_file``. Data tokens were encoded with
        ``encode_special_tokens = True`` (a literal ``<|endoftext|>`` in a file is text, not the separator);
        set the same on the loaded tokenizer to reproduce them exactly.

        Once the splits are loaded it names their entry without listing the corpus again (litgpt's checkpoint
        hook asks at every save), and so stays the tokenizer of the tokens being trained on even if the files
        change during the run.
        """
        if self.tokenizer == "byte":
            return None
        entry = self._loaded[0] if self._loaded is not None else self._token_cache().entry_dir(self._list_corpus())
        return entry / "tokenizer.json"

    def token_splits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (train, validation) token streams as 1-D int64 tensors, building the cache if needed.

        Needs no :meth:`connect`: the demo and tests use it to sample their own windows.
        """
        train, val = self._splits()
        return train.long(), val.long()

    # ------------------------------------------------------------------------------------ DataModule hooks

    def connect(
        self,
        tokenizer: Any = None,
        batch_size: int = 1,
        max_seq_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        """Take litgpt's micro-batch size and the model's block size (the window is ``max_seq_length + 1``).

        Raises:
            ValueError: ``tokenizer`` is not None (litgpt's ``tokenizer_dir`` was set; this module trains its
                own), ``max_seq_length`` is unset, or ``batch_size`` < 1.
        """
        if tokenizer is not None:
            raise ValueError(
                "TextFolder tokenizes the text itself and cannot use a litgpt tokenizer: unset tokenizer_dir "
                "and choose the tokenizer with data.init_args.tokenizer ('byte' or 'bpe', with vocab_size)."
            )
        if max_seq_length is None or max_seq_length < 1:
            raise ValueError(
                f"TextFolder needs the sequence length (got max_seq_length={max_seq_length!r}): litgpt passes "
                "the model's block_size; set model_config.block_size or train.max_seq_length."
            )
        if batch_size < 1:
            raise ValueError(f"TextFolder: batch_size={batch_size!r} must be >= 1.")
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length

    def check_text(self) -> None:
        """Raise ``ValueError`` unless the corpus holds text: what the cache build would refuse, found cheaply.

        Lists the files and reads them in order only until the first ``SNIFF_BYTES`` of text are found, so a
        missing, empty or binary-only folder is refused before any process is launched.
        """
        if self.path is None:
            return
        _check_corpus_path(self.path)
        _read_documents(_Corpus.scan(self.path), str(self.path), SNIFF_BYTES)

    def prepare_data(self) -> None:
        """Read, split and tokenize the corpus into the cache, unless an up-to-date entry is there.

        Safe to call from every rank at once. When :meth:`connect` was called, also checks that both splits
        hold at least one window, so a too-small corpus fails here rather than mid-run.
        """
        entry = self._token_cache().ensure_entry()
        if self.max_seq_length is not None:
            meta = json.loads((entry / "meta.json").read_text())
            self._check_fits(meta["train_tokens"], meta["val_tokens"])

    def setup(self, stage: str = "") -> None:
        """Load the cached splits (memory-mapped) and check they fit at least one window each."""
        train, val = self._splits()
        if self.max_seq_length is not None:
            self._check_fits(len(train), len(val))

    def train_dataloader(self) -> DataLoader:
        """Shuffled windows of ``max_seq_length + 1`` tokens, ``batch_size`` per batch, the last partial one dropped.

        The loader is a :class:`ResumableDataLoader`: a checkpoint that holds it resumes at the same batch.
        """
        seq = self._require_connected()
        train, val = self._splits()
        self._check_fits(len(train), len(val))
        dataset = TokenWindows(train, seq)
        if len(dataset) < self.batch_size:
            # drop_last would leave no batch at all, and litgpt's CycleIterator would then fail obscurely.
            raise ValueError(
                f"TextFolder: the train split has {len(dataset)} windows of {seq + 1} tokens, fewer than "
                f"batch_size={self.batch_size}. Lower train.micro_batch_size or max_seq_length, or add text."
            )
        generator = torch.Generator().manual_seed(self.seed)
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=True,
            generator=generator,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation windows in order (the same every evaluation), ``batch_size`` per batch, none dropped."""
        seq = self._require_connected()
        train, val = self._splits()
        self._check_fits(len(train), len(val))
        return DataLoader(
            TokenWindows(val, seq),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=False,
            num_workers=self.num_workers,
        )

    # ---------------------------------------------------------------------------------------------- checks

    def _require_connected(self) -> int:
        """``max_seq_length``, which :meth:`connect` sets; the dataloaders cannot be built without it."""
        if self.max_seq_length is None:
            raise RuntimeError("TextFolder: call connect(batch_size=..., max_seq_length=...) before the dataloaders.")
        return self.max_seq_length

    def _check_fits(self, n_train: int, n_val: int) -> None:
        """Both splits must hold one window of ``max_seq_length + 1`` tokens; say what to lower if not."""
        assert self.max_seq_length is not None
        need = self.max_seq_length + 1
        if n_train >= need and n_val >= need:
            return
        short = [
            f"the {name} split has {n} tokens" for name, n in (("train", n_train), ("validation", n_val)) if n < need
        ]
        advice = "Lower the sequence length (model block_size or train.max_seq_length), add text"
        if self.max_bytes is not None:
            advice += f", raise max_bytes (now {self.max_bytes})"
        if n_val < need <= n_train:
            advice += f", or raise val_fraction (now {self.val_fraction})"
        raise ValueError(
            f"TextFolder: the corpus is too small for max_seq_length={self.max_seq_length}: "
            f"{' and '.join(short)}, but each split needs at least {need} tokens (one window). {advice}."
        )

    # ----------------------------------------------------------------------------------------------- cache

    def _token_cache(self) -> _TokenCache:
        """The token cache of the current settings (made afresh each time: the settings are plain fields)."""
        return _TokenCache(
            path=self.path,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size_bound,
            val_fraction=self.val_fraction,
            max_bytes=self.max_bytes,
            cache_dir=self.cache_dir,
        )

    def _list_corpus(self) -> _Corpus:
        """The corpus as listed now: every candidate file with its size and modification time (no reading)."""
        return _Corpus.scan(self.path)

    def _splits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (train, val) tensors in their stored dtype, loaded once per cache entry."""
        entry = self._token_cache().ensure_entry()
        if self._loaded is None or self._loaded[0] != entry:
            train = torch.load(entry / "train.pt", mmap=True, weights_only=True)
            val = torch.load(entry / "val.pt", mmap=True, weights_only=True)
            self._loaded = (entry, train, val)
        return self._loaded[1], self._loaded[2]


# ---------------------------------------------------------------------------------------------- token cache


@dataclass(frozen=True)
class _TokenCache:
    """The on-disk token cache of one corpus and its settings: naming, checking and building its entry.

    An entry is a folder ``{tokenizer}-{hash}`` under ``cache_dir`` holding ``train.pt``, ``val.pt``, for "bpe"
    ``tokenizer.json``, and ``meta.json``, written last. The hash (:meth:`entry_dir`) covers the corpus root
    and whether it is the standard-library default, every listed file's relative path, size, modification
    time and permission bits, ``tokenizer``, ``vocab_size``, ``val_fraction``, ``max_bytes`` and
    :data:`FORMAT_VERSION`; not ``cache_dir``, which is where the entry lives. An entry is built in a
    temporary folder and renamed into place, so it only ever appears complete.
    """

    path: Path | None  # TextFolder's path; None: the standard library's sources
    tokenizer: TokenizerKind
    vocab_size: int  # the ids the tokens use: 256 for "byte", the BPE vocabulary size for "bpe"
    val_fraction: float
    max_bytes: int | None
    cache_dir: Path | None  # None: default_cache_dir()

    def entry_dir(self, corpus: _Corpus) -> Path:
        """Where the entry of ``corpus`` (as listed now) and these settings lives, built or not."""
        payload = {
            "format": FORMAT_VERSION,
            "root": str(corpus.root),
            "stdlib_default": self.path is None,
            "files": [[s.rel, s.size, s.mtime_ns, s.mode] for s in corpus.sources],
            "max_bytes": self.max_bytes,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "val_fraction": self.val_fraction,
        }
        key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()
        cache = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        return cache / f"{self.tokenizer}-{key[:24]}"

    def ensure_entry(self) -> Path:
        """The entry of the current corpus and settings, built first if missing or incomplete."""
        corpus = _Corpus.scan(self.path)
        entry = self.entry_dir(corpus)
        if _entry_complete(entry, self.tokenizer):
            return entry
        if entry.exists():
            if _entry_complete(entry, self.tokenizer):  # another rank renamed its entry into place just now
                return entry
            # An entry missing a file was damaged by hand (entries only ever appear complete, by rename):
            # move it aside atomically so a concurrent rank never reads it, then rebuild.
            with contextlib.suppress(OSError):
                aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.stale.", dir=entry.parent))
                os.replace(entry, aside / "old")
                shutil.rmtree(aside, ignore_errors=True)
        self._build(corpus, entry)
        return entry

    def _build(self, corpus: _Corpus, entry: Path) -> None:
        """Read, split, tokenize and save into a temporary folder, then rename it to ``entry`` atomically."""
        start = time.perf_counter()
        where = str(self.path) if self.path is not None else f"{corpus.root} (the standard library's sources)"
        docs, stats = _read_documents(corpus, where, self.max_bytes)
        n_bytes = sum(len(d) for _, d in docs)
        print(
            f"TextFolder: tokenizing {len(docs)} files ({n_bytes / 1e6:.1f} MB) with the {self.tokenizer} "
            f"tokenizer into {entry}",
            file=sys.stderr,
            flush=True,
        )
        train_pieces, val_pieces, mode = _split_documents(docs, self.val_fraction)
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            train, val, trained_vocab = self._tokenize(train_pieces, val_pieces, tmp)
            torch.save(train, tmp / "train.pt")
            torch.save(val, tmp / "val.pt")
            meta = {
                "format": FORMAT_VERSION,
                "root": str(corpus.root),
                "tokenizer": self.tokenizer,
                "vocab_size": trained_vocab,
                "files": len(docs),
                "bytes": n_bytes,
                "split": mode,
                "train_tokens": len(train),
                "val_tokens": len(val),
                "val_files": [rel for rel, _ in docs if mode == "files" and _split_fraction(rel) < self.val_fraction],
                "seconds": round(time.perf_counter() - start, 3),
                **stats,
            }
            # meta.json is written last: its presence marks a complete entry.
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
            try:
                os.rename(tmp, entry)
            except OSError:
                # Another rank renamed its (identical) entry into place first; keep that one.
                if not _entry_complete(entry, self.tokenizer):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _tokenize(
        self, train_pieces: list[tuple[bytes, bool]], val_pieces: list[tuple[bytes, bool]], folder: Path
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The (train, val) tokens and the vocabulary size they use; a BPE is saved as ``folder/tokenizer.json``."""
        if self.tokenizer == "byte":
            return _byte_tokens(train_pieces), _byte_tokens(val_pieces), 256
        # The BPE is trained on the train split only, so it never sees validation text.
        bpe = _train_bpe(train_pieces, self.vocab_size)
        (folder / "tokenizer.json").write_text(bpe.to_str(), encoding="utf-8")
        train = _bpe_tokens(bpe, train_pieces, self.vocab_size)
        val = _bpe_tokens(bpe, val_pieces, self.vocab_size)
        return train, val, bpe.get_vocab_size()


def _entry_complete(entry: Path, kind: str) -> bool:
    """Whether ``entry`` holds every file of a cache entry of tokenizer ``kind`` (``meta.json`` is written last)."""
    names = ["train.pt", "val.pt", "meta.json"] + (["tokenizer.json"] if kind == "bpe" else [])
    return all((entry / n).is_file() for n in names)


# ----------------------------------------------------------------------------------------------- tokenizers


def _byte_tokens(pieces: list[tuple[bytes, bool]]) -> torch.Tensor:
    """The pieces' bytes as a uint8 tensor, ``BYTE_EOT`` after each piece that ends a document."""
    out = bytearray()
    for data, ends in pieces:
        out += data
        if ends:
            out.append(BYTE_EOT)
    if not out:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(out, dtype=torch.uint8)


def _train_bpe(pieces: list[tuple[bytes, bool]], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenization) with ``<|endoftext|>`` as id 0, trained on ``pieces``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOT],
        # All 256 byte symbols, so any text encodes even if the train split lacks some bytes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for data, _ in pieces:
            yield data.decode("utf-8")

    bpe.train_from_iterator(texts(), trainer=trainer, length=len(pieces))
    # A literal "<|endoftext|>" inside a file is text; only the separators we append are the special token.
    bpe.encode_special_tokens = True
    return bpe


def _bpe_tokens(bpe: Any, pieces: list[tuple[bytes, bool]], vocab_size: int) -> torch.Tensor:
    """The pieces encoded with ``bpe``, the end-of-text id after each document, as int16 (or int32)."""
    eot = bpe.token_to_id(BPE_EOT)
    dtype = torch.int16 if vocab_size <= 2**15 else torch.int32
    chunks: list[torch.Tensor] = []
    for batch in _batches(pieces, _ENCODE_BATCH_BYTES):
        encodings = bpe.encode_batch([data.decode("utf-8") for data, _ in batch], add_special_tokens=False)
        for (_, ends), enc in zip(batch, encodings, strict=True):
            ids = [*enc.ids, eot] if ends else enc.ids
            if ids:
                chunks.append(torch.tensor(ids, dtype=torch.int32).to(dtype))
    if not chunks:
        return torch.empty(0, dtype=dtype)
    return torch.cat(chunks)


def _batches(pieces: list[tuple[bytes, bool]], max_bytes: int) -> Iterator[list[tuple[bytes, bool]]]:
    """Consecutive runs of ``pieces`` holding about ``max_bytes`` of text each (a larger piece alone)."""
    batch: list[tuple[bytes, bool]] = []
    size = 0
    for piece in pieces:
        if batch and size + len(piece[0]) > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += len(piece[0])
    if batch:
        yield batch
