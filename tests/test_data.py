"""lightning_scape.litgpt.data.TextFolder: windows, deterministic splits, the cache, BPE, errors, the stdlib default."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import same, write_corpus
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_scape.litgpt import data as data_module
from lightning_scape.litgpt.data import BYTE_EOT, ResumableDataLoader, TextFolder, stdlib_root


def byte_documents(tokens: torch.Tensor) -> list[bytes]:
    """A byte-level token stream cut at its end-of-text bytes (the trailing empty piece dropped)."""
    pieces = bytes(tokens.to(torch.uint8).tolist()).split(bytes([BYTE_EOT]))
    assert pieces[-1] == b""
    return pieces[:-1]


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    folder = tmp_path / "corpus"
    folder.mkdir()
    return folder, write_corpus(folder, 40)


def test_windows_have_shape_b_t_plus_1_and_follow_the_text(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    folder, files = corpus
    data = TextFolder(path=folder, cache_dir=tmp_path / "cache", val_fraction=0.2)
    data.connect(batch_size=4, max_seq_length=32)
    data.prepare_data()
    data.setup()
    train, val = data.token_splits()
    assert train.dtype == val.dtype == torch.int64 and train.dim() == val.dim() == 1

    # The stream is the files' exact bytes, each followed by the end-of-text byte; every file is in one split.
    train_docs, val_docs = byte_documents(train), byte_documents(val)
    assert sorted(train_docs + val_docs) == sorted(files.values())

    loader = data.train_dataloader()
    batch = next(iter(loader))
    assert batch.shape == (4, 33) and batch.dtype == torch.int64
    dataset = loader.dataset
    assert len(dataset) == (len(train) - 1) // 32
    for i in (0, 1, len(dataset) - 1):  # windows overlap by one token: the last target is the next first input
        assert torch.equal(dataset[i], train[i * 32 : i * 32 + 33])
    assert all(any(torch.equal(row, dataset[i]) for i in range(len(dataset))) for row in batch)

    val_batches = list(data.val_dataloader())
    assert torch.equal(val_batches[0][0], val[:33])  # in order, not shuffled
    assert sum(len(b) for b in val_batches) == (len(val) - 1) // 32  # nothing dropped


def test_split_is_deterministic_disjoint_and_stable_when_files_are_added(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    folder, files = corpus
    a = TextFolder(path=folder, cache_dir=tmp_path / "a", val_fraction=0.2).token_splits()
    b = TextFolder(path=folder, cache_dir=tmp_path / "b", val_fraction=0.2).token_splits()  # built independently
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    train_docs, val_docs = set(byte_documents(a[0])), set(byte_documents(a[1]))
    assert val_docs and train_docs and not (train_docs & val_docs)  # split at the file level
    assert train_docs | val_docs == set(files.values())

    # A new file never moves an existing one to the other split.
    (folder / "zzz_new.txt").write_text("a brand new document " * 20)
    c = TextFolder(path=folder, cache_dir=tmp_path / "a", val_fraction=0.2).token_splits()
    assert train_docs <= set(byte_documents(c[0])) and val_docs <= set(byte_documents(c[1]))


def test_single_file_falls_back_to_splitting_the_text(tmp_path: Path) -> None:
    text = "€" * 3334  # 10002 bytes of 3-byte characters: the cut must move back to a character boundary
    (tmp_path / "one.txt").write_text(text)
    train, val = TextFolder(path=tmp_path / "one.txt", cache_dir=tmp_path / "cache", val_fraction=0.1).token_splits()
    # int(10002 * 0.9) = 9001 falls inside a character, so the cut is at 9000; the end-of-text byte is in val.
    assert len(train) == 9000 and len(val) == 10002 - 9000 + 1
    assert bytes(train.to(torch.uint8).tolist()).decode() == "€" * 3000
    assert bytes(torch.cat([train, val]).to(torch.uint8).tolist()) == text.encode() + bytes([BYTE_EOT])

    # Two files that hash to the same split fall back too: the last 10% of the concatenated text is validation.
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.txt").write_text("a" * 600)
    (folder / "b.txt").write_text("b" * 400)
    train, val = TextFolder(path=folder, cache_dir=tmp_path / "cache", val_fraction=0.1).token_splits()
    stream = bytes(torch.cat([train, val]).to(torch.uint8).tolist())
    assert stream == b"a" * 600 + bytes([BYTE_EOT]) + b"b" * 400 + bytes([BYTE_EOT])
    assert len(train) == 901 and bytes(val.to(torch.uint8).tolist()) == b"b" * 100 + bytes([BYTE_EOT])


def test_cache_is_reused_and_invalidated_when_a_file_changes(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = corpus
    cache = tmp_path / "cache"
    first = TextFolder(path=folder, cache_dir=cache).token_splits()
    reads: list[Path] = []
    real_read = data_module._read_file

    def counting_read(path: Path, limit: int) -> bytes:
        reads.append(path)
        return real_read(path, limit)

    monkeypatch.setattr(data_module, "_read_file", counting_read)
    again = TextFolder(path=folder, cache_dir=cache)
    again.prepare_data()
    second = again.token_splits()
    assert reads == [] and torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert len(list(cache.iterdir())) == 1  # one entry, no leftover temporary folders

    (folder / "doc000.txt").write_text("changed content\n")
    third = TextFolder(path=folder, cache_dir=cache).token_splits()
    assert len(reads) == 40  # re-read and re-tokenized
    assert b"changed content\n" in byte_documents(third[0]) + byte_documents(third[1])
    # The same instance notices the change too (its loaded tensors are keyed by the cache entry).
    (folder / "doc001.txt").write_text("changed again\n")
    train, val = again.token_splits()
    assert b"changed again\n" in byte_documents(train) + byte_documents(val)
    # A different setting is a different entry.
    TextFolder(path=folder, cache_dir=cache, val_fraction=0.3).prepare_data()
    assert len(list(cache.iterdir())) == 4
    # So is a permission change: a file skipped as unreadable may have become readable (chmod keeps the mtime).
    (folder / "doc002.txt").chmod(0o600)
    TextFolder(path=folder, cache_dir=cache, val_fraction=0.3).prepare_data()
    assert len(list(cache.iterdir())) == 5


def test_an_entry_another_rank_renames_into_place_meanwhile_is_used_not_removed(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, _ = corpus
    cache = tmp_path / "cache"
    first = TextFolder(path=folder, cache_dir=cache).token_splits()
    (entry,) = cache.iterdir()
    # This rank looks before the other rank's rename lands (incomplete), and finds the folder there just after.
    real_complete, looks = data_module._entry_complete, []

    def rename_lands_after_the_first_look(path: Path, kind: str) -> bool:
        looks.append(path)
        return len(looks) > 1 and real_complete(path, kind)

    monkeypatch.setattr(data_module, "_entry_complete", rename_lands_after_the_first_look)
    monkeypatch.setattr(data_module, "_read_file", lambda path, limit: pytest.fail("rebuilt a complete entry"))
    again = TextFolder(path=folder, cache_dir=cache).token_splits()
    assert [p.name for p in cache.iterdir()] == [entry.name] and torch.equal(first[0], again[0])


def test_bpe_trains_caches_and_round_trips(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer

    folder, files = corpus
    (folder / "special.txt").write_text('marker = "<|endoftext|>"  # é € 😀\n')  # literal EOT text is not EOT
    data = TextFolder(path=folder, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert data.vocab_size_bound == 300
    data.prepare_data()
    assert data.tokenizer_path is not None and data.tokenizer_path.is_file()
    assert data.tokenizer_path.name == "tokenizer.json"
    train, val = data.token_splits()
    assert train.dtype == torch.int64 and int(torch.cat([train, val]).min()) >= 0
    assert int(torch.cat([train, val]).max()) < 300

    bpe = Tokenizer.from_file(str(data.tokenizer_path))
    bpe.encode_special_tokens = True
    eot = bpe.token_to_id("<|endoftext|>")
    assert eot == 0
    assert int((train == eot).sum() + (val == eot).sum()) == len(files) + 1  # one per document
    texts = [p.read_text() for p in sorted(folder.rglob("*.txt"))]
    for text in texts:
        assert bpe.decode(bpe.encode(text).ids) == text
    # The stored streams decode back to the files, document by document.
    decoded = []
    for stream in (train, val):
        ids = stream.tolist()
        start = 0
        for i, t in enumerate(ids):
            if t == eot:
                decoded.append(bpe.decode(ids[start:i]))
                start = i + 1
    assert sorted(decoded) == sorted(texts)

    # Second instance: served from the cache, the tokenizer not retrained.
    monkeypatch.setattr(data_module, "_read_file", lambda path, limit: pytest.fail("re-read a cached corpus"))
    again = TextFolder(path=folder, tokenizer="bpe", vocab_size=300, cache_dir=tmp_path / "cache", val_fraction=0.2)
    assert torch.equal(again.token_splits()[0], train) and again.tokenizer_path == data.tokenizer_path
    assert TextFolder(path=folder, cache_dir=tmp_path / "cache").tokenizer_path is None  # byte

    # A file edited during the run: the loaded splits' tokenizer is still the one named (a fresh listing would
    # name a new, not yet built entry, and litgpt's checkpoints would lose their tokenizer.json).
    (folder / "special.txt").write_text("edited mid-run\n")
    assert again.tokenizer_path == data.tokenizer_path and again.tokenizer_path.is_file()


def test_max_bytes_truncates_in_sorted_order(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "a.txt").write_text("a" * 100)
    (folder / "b.txt").write_text("é" * 100)  # 200 bytes
    (folder / "c.txt").write_text("c" * 100)
    train, val = TextFolder(path=folder, cache_dir=tmp_path / "cache", max_bytes=151).token_splits()
    stream = bytes(torch.cat([train, val]).to(torch.uint8).tolist())
    # 100 bytes of a.txt, then 51 bytes of b.txt cut back to 50 (a character boundary); c.txt is not read.
    assert stream.replace(bytes([BYTE_EOT]), b"") == b"a" * 100 + "é".encode() * 25


def test_hidden_and_binary_files_are_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD.txt").write_text("hidden folder " * 50)
    (folder / ".hidden.txt").write_text("hidden file " * 50)
    (folder / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)))
    (folder / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)  # not UTF-8
    (folder / "empty.txt").write_text("")
    (folder / "text.md").write_text("kept " * 100)
    train, val = TextFolder(path=folder, cache_dir=tmp_path / "cache").token_splits()
    # One file left, so the split falls back to its text: train + val is that file and its end-of-text byte.
    assert bytes(torch.cat([train, val]).to(torch.uint8).tolist()) == b"kept " * 100 + bytes([BYTE_EOT])


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_fraction": 0.0}, "val_fraction=0.0 must lie in (0, 0.5]"),
        ({"val_fraction": 0.6}, "val_fraction=0.6"),
        ({"tokenizer": "bpe", "vocab_size": 100}, "vocab_size=100 is too small for a BPE"),
        ({"max_bytes": 0}, "max_bytes=0 must be a positive number"),
        ({"tokenizer": "wordpiece"}, "tokenizer='wordpiece' is unknown"),
        ({"num_workers": -1}, "num_workers=-1"),
    ],
)
def test_invalid_settings_say_what_to_change(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Invalid TextFolder") as err:
        TextFolder(path=tmp_path, **kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist.*data.init_args.path"):
        TextFolder(path=tmp_path / "nope")


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "corpus" / ".hidden").mkdir(parents=True)
    (tmp_path / "corpus" / ".hidden" / "x.txt").write_text("hidden")
    with pytest.raises(ValueError, match="no files under"):
        TextFolder(path=tmp_path / "corpus", cache_dir=tmp_path / "cache").prepare_data()


def test_folder_of_binary_files(tmp_path: Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"\x00\x01\x02" * 100)
    (folder / "b.dat").write_bytes(b"\xff\xfe\x00\x00" * 100)
    with pytest.raises(ValueError, match=r"no readable text files.*2 skipped as binary"):
        TextFolder(path=folder, cache_dir=tmp_path / "cache").prepare_data()


def test_unreadable_files_warn_and_all_unreadable_is_an_error(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, files = corpus
    real_read = data_module._read_file

    def read(path: Path, limit: int) -> bytes:
        if path.name in ("doc005.txt", "only.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path, limit)

    monkeypatch.setattr(data_module, "_read_file", read)
    message = r"skipped 1 unreadable file\(s\) or folder\(s\): .*doc005\.txt \(Permission denied\)"
    with pytest.warns(UserWarning, match=message):
        train, val = TextFolder(path=folder, cache_dir=tmp_path / "cache").token_splits()
    assert len(byte_documents(train)) + len(byte_documents(val)) == len(files) - 1

    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "only.txt").write_text("secret")
    with pytest.raises(PermissionError, match=r"every file under .* is unreadable, e.g. .*only.txt"):
        TextFolder(path=lonely, cache_dir=tmp_path / "cache").prepare_data()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads files despite chmod 000")
def test_unreadable_file_with_real_permissions(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "only.txt").write_text("secret")
    (folder / "only.txt").chmod(0)
    try:
        with pytest.raises(PermissionError, match=r"only\.txt"):
            TextFolder(path=folder, cache_dir=tmp_path / "cache").prepare_data()
    finally:
        (folder / "only.txt").chmod(0o644)


def test_corpus_too_small_names_the_counts(tmp_path: Path) -> None:
    (tmp_path / "small.txt").write_text("x" * 999)
    data = TextFolder(path=tmp_path / "small.txt", cache_dir=tmp_path / "cache", val_fraction=0.1)
    data.connect(batch_size=1, max_seq_length=512)
    with pytest.raises(ValueError, match=r"too small for max_seq_length=512: the validation split has 101 tokens") as e:
        data.prepare_data()
    assert "at least 513 tokens" in str(e.value) and "raise val_fraction" in str(e.value)
    data.connect(batch_size=1, max_seq_length=2048)
    with pytest.raises(ValueError, match="the train split has 899 tokens and the validation split has 101"):
        data.setup()
    data.connect(batch_size=200, max_seq_length=8)  # (899 - 1) // 8 = 112 windows
    with pytest.raises(ValueError, match="112 windows of 9 tokens, fewer than batch_size=200"):
        data.train_dataloader()


def test_connect_refuses_a_litgpt_tokenizer_and_a_missing_length(tmp_path: Path) -> None:
    data = TextFolder(path=tmp_path)
    with pytest.raises(ValueError, match="unset tokenizer_dir"):
        data.connect(tokenizer=object(), batch_size=2, max_seq_length=16)
    for length in (None, -1):
        with pytest.raises(ValueError, match="needs the sequence length"):
            data.connect(batch_size=2, max_seq_length=length)
    with pytest.raises(RuntimeError, match="call connect"):
        data.train_dataloader()


# ------------------------------------------------------------------------------------- defaults and wiring


def test_stdlib_default_finds_python_sources(tmp_path: Path) -> None:
    root = stdlib_root()
    assert root.is_dir() and (root / "os.py").is_file()
    data = TextFolder(max_bytes=200_000, cache_dir=tmp_path / "cache")
    assert data.path is None and data.vocab_size_bound == 256
    train, val = data.token_splits()
    assert len(train) > 100_000 and len(val) > 0
    text = bytes(torch.cat([train, val]).to(torch.uint8).tolist()).replace(bytes([BYTE_EOT]), b"")
    assert 200_000 - 3 <= len(text) <= 200_000  # the last file is cut at a character boundary
    assert b"def " in text and b"import " in text
    meta = json.loads(next((tmp_path / "cache").glob("byte-*/meta.json")).read_text())
    assert meta["files"] > 3
    rels = [s.rel for s in data._list_corpus().sources]  # the whole default corpus, as listed (not read)
    assert "os.py" in rels and "json/decoder.py" in rels and rels == sorted(rels)
    assert all(r.endswith(".py") and not {"test", "tests", "site-packages"} & set(r.split("/")) for r in rels)


def test_distributed_sampler_gives_each_rank_disjoint_windows(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    data = TextFolder(path=corpus[0], cache_dir=tmp_path / "cache")
    data.connect(batch_size=2, max_seq_length=16)
    loader = data.train_dataloader()
    # Fabric swaps in a DistributedSampler with shuffle=True exactly when the loader's sampler is a RandomSampler.
    assert isinstance(loader.sampler, RandomSampler) and loader.drop_last
    assert isinstance(data.val_dataloader().sampler, SequentialSampler)
    ranks = [
        list(DistributedSampler(loader.dataset, num_replicas=2, rank=r, shuffle=True, seed=7, drop_last=True))
        for r in (0, 1)
    ]
    assert not set(ranks[0]) & set(ranks[1])
    assert len(ranks[0]) == len(ranks[1]) == len(loader.dataset) // 2
    assert ranks[0] != sorted(ranks[0])  # shuffled


def test_constructible_from_a_recipe_by_jsonargparse(tmp_path: Path) -> None:
    from jsonargparse import ArgumentParser
    from litgpt.data import DataModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--data", type=DataModule)
    recipe = {
        "data": {
            "class_path": "lightning_scape.litgpt.data.TextFolder",
            "init_args": {"path": None, "tokenizer": "bpe", "vocab_size": 16384, "max_bytes": 4000000},
        }
    }
    data = parser.instantiate_classes(parser.parse_object(recipe)).data
    assert isinstance(data, TextFolder)
    assert data.path is None and data.tokenizer == "bpe" and data.vocab_size_bound == 16384
    assert data.max_bytes == 4_000_000 and data.val_fraction == 0.05
    recipe["data"]["init_args"] = {"path": str(tmp_path), "cache_dir": str(tmp_path / "c")}
    data = parser.instantiate_classes(parser.parse_object(recipe)).data
    assert data.path == tmp_path and data.cache_dir == tmp_path / "c"


def _take(iterator: Iterator[torch.Tensor], n: int) -> list[torch.Tensor]:
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("distributed", [False, True])
def test_train_loader_resumes_at_the_same_batch_across_epochs(
    corpus: tuple[Path, dict[str, bytes]], tmp_path: Path, distributed: bool
) -> None:
    """Twin loaders: one runs through, the other is rebuilt from a state dict mid-epoch (what a resume does)."""
    data = TextFolder(path=corpus[0], cache_dir=tmp_path / "cache")
    data.connect(batch_size=4, max_seq_length=16)

    def make() -> ResumableDataLoader:
        loader = data.train_dataloader()
        assert isinstance(loader, ResumableDataLoader)
        if distributed:  # how Fabric rebuilds it: same class, a DistributedSampler instead of the RandomSampler
            sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
            loader = ResumableDataLoader(loader.dataset, batch_size=4, sampler=sampler, drop_last=True)
        return loader

    def cycle(loader: ResumableDataLoader) -> Iterator[torch.Tensor]:  # litgpt's CycleIterator
        while True:
            yield from loader

    reference = make()
    per_epoch = len(reference)
    assert per_epoch >= 4
    stop = per_epoch + per_epoch // 2  # half-way through the second epoch
    ref_iter = cycle(reference)
    first = _take(ref_iter, stop)
    state = reference.state_dict()
    assert state == {"epoch": 1, "position": per_epoch // 2}
    rest = _take(ref_iter, per_epoch)

    second_epoch = first[per_epoch:] + rest[: per_epoch - per_epoch // 2]
    assert not same(first[:per_epoch], second_epoch)  # every epoch is shuffled anew

    resumed = make()
    resumed.load_state_dict(state)
    assert same(_take(cycle(resumed), per_epoch), rest)
    # A fresh loader without a state starts at epoch 0 again.
    assert same(_take(cycle(make()), per_epoch), first[:per_epoch])
