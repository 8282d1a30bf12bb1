"""The shared workloads: model presets, optimizer groups, schedule, batches, validation, corpora and free_port."""

from __future__ import annotations

import itertools
import json
import math
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_scape.examples import workloads
from lightning_scape.examples.workloads import (
    CORPORA,
    MODEL_PRESETS,
    PROSE_MANIFEST,
    adams_optimizer,
    build_model,
    corpus_tokens,
    cosine_lr,
    free_port,
    prose_corpus,
    sample_batch,
    set_cosine_lr,
    validation_batch_losses,
    validation_loss,
    weight_decay_groups,
)
from lightning_scape.litgpt.data import BYTE_EOT, TextFolder


@pytest.fixture(scope="module")
def prose_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding one build of the prose corpus (about 10 s), shared by this module's tests."""
    cache = tmp_path_factory.mktemp("cache")
    prose_corpus(cache)
    return cache


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _text(tokens: torch.Tensor) -> bytes:
    """Byte tokens back to text, the end-of-text separators dropped."""
    return bytes(tokens.to(torch.uint8).tolist()).replace(bytes([BYTE_EOT]), b"")


# ------------------------------------------------------------------------------------------------ the model


def _llama_params(vocab: int, n_layer: int, n_embd: int, intermediate_size: int, **_: int) -> int:
    """Embedding + head, per layer 2 RMSNorms + q/k/v/o + SwiGLU (3 matrices), final RMSNorm; no biases."""
    per_layer = 2 * n_embd + 4 * n_embd * n_embd + 3 * n_embd * intermediate_size
    return 2 * vocab * n_embd + n_layer * per_layer + n_embd


@pytest.mark.parametrize(("preset", "count"), [("tiny", 131_904), ("small", 857_216), ("base", 4_877_568)])
def test_presets_have_their_documented_parameter_counts(preset: str, count: int) -> None:
    model = build_model(block_size=64, preset=preset)
    assert sum(p.numel() for p in model.parameters()) == count == _llama_params(256, **MODEL_PRESETS[preset])
    # The rotary embedding has no parameters: the count does not depend on the block size.
    assert sum(p.numel() for p in build_model(block_size=256, preset=preset).parameters()) == count


def test_small_is_the_demos_086m_model_and_the_default() -> None:
    model = build_model(block_size=32)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 0.86
    assert model.config.n_layer == 4 and model.config.n_embd == 128 and model.config.padded_vocab_size == 256


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = build_model(32, preset="tiny"), build_model(32, preset="tiny"), build_model(32, preset="tiny", seed=1)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True))


def build_at_once(ranks: int) -> list[torch.nn.Module]:
    """``ranks`` threads released together, each building the tiny model from seed 0."""
    start, models = threading.Barrier(ranks), [torch.nn.Module()] * ranks

    def build(rank: int) -> None:
        start.wait()
        models[rank] = build_model(64, preset="tiny", seed=0)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return models


def test_simulated_ranks_building_at_once_get_the_same_weights() -> None:
    # Threads share torch's global generator: unguarded, four builders at once interleave its draws (every try).
    for _ in range(3):
        first, *others = (list(m.parameters()) for m in build_at_once(4))
        assert first and all(torch.equal(a, b) for o in others for a, b in zip(first, o, strict=True))


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'; choose one of \['tiny', 'small', 'base'\]"):
        build_model(32, preset="huge")


def test_weight_decay_only_on_matrices() -> None:
    model = build_model(32, preset="tiny")
    decay, no_decay = weight_decay_groups(model)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # every parameter exactly once
    opt = adams_optimizer(model, lr=1e-3)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3]


# ------------------------------------------------------------------------------------------ the training step


def test_cosine_lr_warms_up_linearly_then_decays_to_zero() -> None:
    steps, peak = 200, 3e-3
    lrs = [cosine_lr(s, steps, peak) for s in range(steps + 1)]
    assert lrs[0] == pytest.approx(peak / 20)  # cosine factor 1 at step 0
    for s in range(20):  # the ramp: (s + 1) / 20 of the cosine
        assert lrs[s] == pytest.approx(peak * (s + 1) / 20 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    assert lrs[19] == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 19 / steps)))
    assert 0.97 * peak < max(lrs) <= peak  # the cosine has already started when the ramp ends
    assert all(a < b for a, b in itertools.pairwise(lrs[:20]))  # up to step 19, the ramp's end
    assert all(a > b for a, b in itertools.pairwise(lrs[19:]))  # down from there
    assert lrs[steps - 1] == pytest.approx(peak * 0.5 * (1 - math.cos(math.pi / steps)))
    assert lrs[steps] == pytest.approx(0.0, abs=1e-18)
    assert cosine_lr(0, steps, peak, warmup_steps=1) == pytest.approx(peak)  # no ramp


def test_set_cosine_lr_sets_every_group() -> None:
    opt = adams_optimizer(build_model(32, preset="tiny"), lr=1.0)
    set_cosine_lr(opt, 50, 100, 2.0, warmup_steps=10)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(1.0)] * 2  # 2.0 * 1 * cos^2(pi/4)


def test_sample_batch_targets_are_the_next_tokens() -> None:
    tokens = torch.arange(1000)
    x, y = sample_batch(tokens, torch.Generator().manual_seed(0), batch=5, block=16)
    assert x.shape == y.shape == (5, 16)
    assert torch.equal(y, x + 1) and torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows of the stream
    assert int(y.max()) <= 999
    x2, _ = sample_batch(tokens, torch.Generator().manual_seed(0), batch=5, block=16)
    assert torch.equal(x, x2)


def test_validation_losses_split_over_ranks_sum_to_one_process() -> None:
    model = build_model(32, preset="tiny")
    val = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(3))
    alone = validation_batch_losses(model, val, 32, batches=5)
    parts = [validation_batch_losses(model, val, 32, batches=5, rank=r, world_size=2) for r in (0, 1)]
    assert torch.count_nonzero(parts[0]) == 3 and torch.count_nonzero(parts[1]) == 2
    assert torch.equal(parts[0] + parts[1], alone)
    assert validation_loss(model, val, 32, batches=5) == pytest.approx(float(alone.mean()))
    assert 4.5 < float(alone.mean()) < 6.5  # an untrained model on random bytes: about ln 256 = 5.55


# ------------------------------------------------------------------------------------------------ the corpora


@pytest.mark.dist
def test_prose_corpus_is_deterministic(prose_cache: Path, tmp_path: Path) -> None:
    first, second = prose_corpus(prose_cache), prose_corpus(tmp_path)
    assert first.name == second.name and first.parent == prose_cache / "corpora"
    files = _files(first)
    assert files == _files(second)  # the same names and bytes, the manifest included
    manifest = json.loads(files.pop(PROSE_MANIFEST))
    assert manifest["files"] == len(files) > 700
    assert manifest["bytes"] == sum(len(b) for b in files.values()) > 2_000_000
    topics = [n for n in files if n.startswith("topics/")]
    modules = [n[len("modules/") : -len(".txt")] for n in files if n.startswith("modules/")]
    assert len(topics) + len(modules) == len(files) and len(topics) > 50
    assert "modules/json.txt" in files and files["modules/json.txt"].startswith(b"JSON (JavaScript Object Notation)")
    assert b"assert" in files["topics/assert.txt"] and "unittest" in modules and "os" in modules
    assert not [m for m in modules if {"test", "tests", "idle_test", "site-packages"} & set(m.split("."))]
    assert all(b.strip() and b.endswith(b"\n") for b in files.values())  # no empty file


def test_prose_corpus_is_built_only_when_missing(prose_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = prose_corpus(prose_cache)

    def no_rebuild(root: Path) -> Iterator[tuple[str, str]]:
        raise AssertionError("the prose corpus was rebuilt although it exists")

    monkeypatch.setattr(workloads, "_prose_documents", no_rebuild)
    assert prose_corpus(prose_cache) == folder


def test_concurrent_builders_leave_one_complete_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    both_started = threading.Barrier(2)

    def documents(root: Path) -> Iterator[tuple[str, str]]:
        both_started.wait(timeout=30)  # both threads are building before either renames
        yield from [("topics/a.txt", "first\n"), ("modules/b.txt", "second\n")]

    monkeypatch.setattr(workloads, "_prose_documents", documents)
    folders: list[Path] = []
    threads = [threading.Thread(target=lambda: folders.append(prose_corpus(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(folders) == 2 and folders[0] == folders[1]
    assert _files(folders[0]) == {
        PROSE_MANIFEST: _files(folders[0])[PROSE_MANIFEST],
        "topics/a.txt": b"first\n",
        "modules/b.txt": b"second\n",
    }
    assert [p.name for p in (tmp_path / "corpora").iterdir()] == [folders[0].name]  # no temporary folder left

    # A folder damaged by hand (its manifest gone) is built again.
    (folders[0] / PROSE_MANIFEST).unlink()
    monkeypatch.setattr(workloads, "_prose_documents", lambda root: iter([("topics/a.txt", "again\n")]))
    assert prose_corpus(tmp_path) == folders[0] and (folders[0] / PROSE_MANIFEST).is_file()
    assert [p.name for p in (tmp_path / "corpora").iterdir()] == [folders[0].name]
    assert (folders[0] / "topics/a.txt").read_bytes() == b"again\n" and not (folders[0] / "modules").exists()


def test_prose_tokens_split_by_file_into_mostly_printable_text(prose_cache: Path) -> None:
    train, val = corpus_tokens("prose", cache_dir=prose_cache)
    assert train.dtype == val.dtype == torch.int64 and int(torch.cat([train, val]).max()) <= 255
    assert len(train) > 1_500_000 and len(val) > 20_000
    manifest = json.loads((prose_corpus(prose_cache) / PROSE_MANIFEST).read_text())
    # Every file is read, whole: train + validation hold all the corpus's bytes, one 0xFF after each file.
    assert len(_text(train)) + len(_text(val)) == manifest["bytes"]
    assert int((train == BYTE_EOT).sum() + (val == BYTE_EOT).sum()) == manifest["files"]
    for split in (train, val):
        text = _text(split)
        printable = sum(1 for c in text if 32 <= c < 127 or c in (9, 10))
        assert printable / len(text) > 0.99
        assert text.count(b" the ") > len(text) / 1000  # English: about 8 per 1000 bytes
    assert _text(val) not in _text(train)


def test_stdlib_tokens_are_textfolders_default_corpus(tmp_path: Path) -> None:
    train, val = corpus_tokens("stdlib", max_bytes=300_000, cache_dir=tmp_path)
    ref_train, ref_val = TextFolder(max_bytes=300_000, cache_dir=tmp_path).token_splits()
    assert torch.equal(train, ref_train) and torch.equal(val, ref_val)
    assert len(train) > 200_000 and len(val) > 0 and b"def " in _text(train)


def test_unknown_corpus_names_the_choices(tmp_path: Path) -> None:
    assert CORPORA == ("stdlib", "prose")
    with pytest.raises(ValueError, match=r"unknown corpus 'shakespeare'; choose one of \['stdlib', 'prose'\]"):
        corpus_tokens("shakespeare", cache_dir=tmp_path)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # refused before anything is read or written


# ------------------------------------------------------------------------------------------- process groups


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
