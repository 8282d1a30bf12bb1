"""``lightning-scape pretrain`` in the FSDP form (``fsdp.shard_size``): checkpoints, resume, the llama-3-8b recipe.

The runs are 4 gloo processes on the CPU as 2 groups of ``shard_size`` 2, started by torchrun, on the debug
recipe with a budget of 8 optimizer steps (2 accumulated micro-batches each), and on the llama-3-8b recipe
shrunk on the command line to a 2-layer, 64-wide model.
"""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PYTHON, child_env

from lightning_scape.examples.workloads import free_port
from lightning_scape.litgpt.pretrain import FSDPArgs, parse, run_pretrain

REPO = Path(__file__).resolve().parent.parent
W, S = 4, 2
STEPS, SAVE_AT = 8, 4  # optimizer steps of 16 sequences of 128 tokens; checkpoints every 4

# litgpt's Llama-3-8B (litgpt.config), the recipe's model.
LLAMA_3_8B_PARAMS = 8_030_261_248
# The llama-3-8b recipe shrunk to a model a CPU trains in seconds, on 4 processes as 2 groups of 2.
TINY_LLAMA_3 = [
    "--accelerator", "cpu", "--devices", str(W), "--fsdp.shard_size", str(S), "--precision", "32-true",
    "--process_group_backend", "gloo", "--compile", "false",
    "--model_config.n_layer", "2", "--model_config.n_embd", "64", "--model_config.n_head", "4",
    "--model_config.n_query_groups", "2", "--model_config.intermediate_size", "128", "--model_config.block_size", "64",
    "--model_config.vocab_size", "256", "--model_config.padded_vocab_size", "256", "--data.tokenizer", "byte",
    "--data.max_bytes", "300000", "--train.global_batch_size", "8", "--train.micro_batch_size", "1",
    "--train.max_tokens", str(2 * 8 * 64), "--train.lr_warmup_steps", "1", "--train.log_interval", "1",
    "--eval.max_iters", "1", "--scape.dense_warmup_steps", "1", "--scape.density_ramp_steps", "0",
    "--scape.chunk_size", "1024",
]  # fmt: skip


def _torchrun(out_dir: Path, cache: Path, *args: str) -> str:
    """``lightning-scape pretrain`` on 4 torchrun processes; its output."""
    command = [
        os.path.join(os.path.dirname(PYTHON), "torchrun"), f"--nproc_per_node={W}", f"--master_port={free_port()}",
        "-m", "lightning_scape", "pretrain", *args, "--out_dir", str(out_dir),
    ]  # fmt: skip
    env = child_env(LIGHTNING_SCAPE_CACHE=str(cache))
    proc = subprocess.run(command, env=env, cwd=out_dir.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def _debug(out_dir: Path, cache: Path, *args: str) -> str:
    """The debug recipe in the FSDP form: 8 steps of 2 micro-batches of 2 per process, checkpoints every 4."""
    return _torchrun(
        out_dir, cache,
        "--config", "debug", "--devices", str(W), "--fsdp.shard_size", str(S), "--train.micro_batch_size", "2",
        "--data.max_bytes", "300000", "--train.log_interval", "1", "--train.save_interval", str(SAVE_AT),
        "--eval.max_iters", "2", "--train.max_tokens", str(STEPS * 16 * 128), "--scape.dense_warmup_steps", "2",
        "--scape.density_ramp_steps", "2", *args,
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The uninterrupted run and one resumed from its step 4 in a fresh folder: (whole, resumed, resumed's log)."""
    root = tmp_path_factory.mktemp("fsdp_pretrain")
    cache, whole, resumed = root / "cache", root / "whole", root / "resumed"
    _debug(whole, cache)
    log = _debug(resumed, cache, "--resume", str(whole / f"step-{SAVE_AT:08d}" / "lit_model.pth"))
    return whole, resumed, log


def _shard(folder: Path, rank: int) -> dict[str, Any]:
    return torch.load(folder / f"shard-{rank:05d}.pt", weights_only=False)


def _assert_equal(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` are the same nested state: tensors bitwise, everything else ``==`` (wait times left out)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            if k != "total_wait_s":  # time spent waiting on collectives: a measurement, not state
                _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.dist
def test_checkpoints_are_sharded_folders_beside_a_whole_litgpt_model(runs: tuple[Path, Path, str]) -> None:
    """Every checkpoint folder holds litgpt's files, with lit_model.pth the whole model gathered from the shards."""
    from litgpt import GPT, Config

    whole, _, _ = runs
    for name in (f"step-{SAVE_AT:08d}", f"step-{STEPS:08d}", "final"):
        folder = whole / name
        assert {"lit_model.pth", "lit_model.pth.scape", "hyperparameters.yaml", "model_config.yaml"} <= {
            p.name for p in folder.iterdir()
        }
        sharded = folder / "lit_model.pth.scape"
        assert sorted(p.name for p in sharded.iterdir()) == ["meta.pt"] + [f"shard-{r:05d}.pt" for r in range(W)]
        meta = torch.load(sharded / "meta.pt", weights_only=False)
        assert (meta["world_size"], meta["shard_size"]) == (W, S)
    final = whole / "final"
    assert torch.load(final / "lit_model.pth.scape" / "meta.pt", weights_only=False)["metadata"]["step_count"] == STEPS
    # lit_model.pth loads strictly into litgpt's GPT of the saved config: a litgpt checkpoint.
    full = torch.load(final / "lit_model.pth", weights_only=True)["model"]
    GPT(Config.from_file(final / "model_config.yaml")).load_state_dict(full, strict=True)
    # Its tensors are each group's two shards end to end (FSDP shards dim 0), and both groups hold the same.
    shards = [_shard(final / "lit_model.pth.scape", r)["modules"]["model"] for r in range(W)]
    for key, tensor in full.items():
        for group in range(W // S):
            joined = torch.cat([shards[group * S + i][key] for i in range(S)])
            assert torch.equal(joined, tensor), (key, group)


@pytest.mark.dist
def test_resume_from_the_sharded_folder_continues_bitwise(runs: tuple[Path, Path, str]) -> None:
    """--resume names step 4's lit_model.pth; the run loads the folder beside it and ends where the whole run did:
    the gathered model, every rank's model shard and SCAPE state (momentum, residual, masks) bitwise equal."""
    whole, resumed, log = runs
    assert f"Resuming training from {whole / f'step-{SAVE_AT:08d}' / 'lit_model.pth.scape'}" in log
    with open(next(resumed.glob("logs/csv/**/metrics.csv"))) as fh:
        iters = sorted(int(r["iter"]) for r in csv.DictReader(fh) if r.get("loss"))
    # 2 micro-batches per step: litgpt continued at iteration 9 (step 5), not from 0.
    assert iters == [2 * step for step in range(SAVE_AT + 1, STEPS + 1)], iters
    _assert_equal(
        torch.load(whole / "final" / "lit_model.pth", weights_only=True),
        torch.load(resumed / "final" / "lit_model.pth", weights_only=True),
        "lit_model.pth",
    )
    for rank in range(W):
        a, b = (_shard(run / "final" / "lit_model.pth.scape", rank) for run in (whole, resumed))
        _assert_equal(a["modules"], b["modules"], f"rank {rank} model")
        _assert_equal(a["optimizers"], b["optimizers"], f"rank {rank} optimizer")
    # The runs moved the model: equal weights are not the initial ones.
    first = torch.load(whole / f"step-{SAVE_AT:08d}" / "lit_model.pth", weights_only=True)["model"]
    last = torch.load(whole / "final" / "lit_model.pth", weights_only=True)["model"]
    assert any(not torch.equal(first[k], last[k]) for k in first)


def test_llama_3_8b_recipe_is_litgpts_llama_3_8b_in_the_fsdp_form(tmp_path: Path) -> None:
    """Parsed only, its model built on the meta device: nothing of 8B parameters is allocated."""
    import dataclasses

    from litgpt import GPT, Config

    _, kwargs = parse(["--config", "llama-3-8b", "--data.cache_dir", str(tmp_path)])
    config, reference = kwargs["model_config"], Config.from_name("Llama-3-8B")
    for field in dataclasses.fields(Config):
        if field.name != "hf_config":
            assert getattr(config, field.name) == getattr(reference, field.name), field.name
    with torch.device("meta"):
        assert sum(p.numel() for p in GPT(config).parameters()) == LLAMA_3_8B_PARAMS
    assert kwargs["fsdp"] == FSDPArgs(shard_size=8) and kwargs["precision"] == "bf16-mixed"
    assert kwargs["train"].global_batch_size % 8 == 0  # whole sequences per process on nodes of 8


@pytest.mark.dist
def test_llama_3_8b_recipe_sets_up_and_trains_shrunk_on_four_processes(tmp_path: Path) -> None:
    """The recipe with a 2-layer, 64-wide model: launched in the FSDP form, 2 steps (the second sparse), saved."""
    out = tmp_path / "llama-3-8b"
    log = _torchrun(out, tmp_path / "cache", "--config", "llama-3-8b", *TINY_LLAMA_3)
    assert "2 optimizer steps of 512 tokens" in log and "Final evaluation | val loss" in log
    assert "x fewer bytes than dense" in log  # step 2 is sparse
    meta = torch.load(out / "final" / "lit_model.pth.scape" / "meta.pt", weights_only=False)
    assert (meta["world_size"], meta["shard_size"], meta["metadata"]["step_count"]) == (W, S, 2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp.shard_size", "3"], "fsdp.shard_size=3 must be a divisor of the 2 processes"),
        (["--fsdp.shard_size", "2", "--precision", "16-mixed"], "not '16-mixed'"),
    ],
)
def test_fsdp_values_that_cannot_work_exit_2_before_launch(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = ["--config", "debug", "--out_dir", str(tmp_path / "out"), "--data.cache_dir", str(tmp_path / "cache")]
    assert run_pretrain([*config, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-scape pretrain:") and message in err, err


def test_resume_path_becomes_the_sharded_folder_beside_lit_model(tmp_path: Path) -> None:
    """litgpt's answer (a stand-in that returns ``resume``) is mapped to the folder beside it, and restored after."""
    from types import SimpleNamespace

    from lightning_scape.litgpt.litgpt_adaptations import find_sharded_resume_path

    def litgpt_find(resume: Any, out_dir: Path) -> Any:
        return resume

    module = SimpleNamespace(find_resume_path=litgpt_find)
    ckpt = tmp_path / "step-00000004" / "lit_model.pth"
    with find_sharded_resume_path(module):
        assert module.find_resume_path(False, tmp_path) is False  # no resume: litgpt's answer as it is
        with pytest.raises(FileNotFoundError, match=r"lit_model\.pth\.scape, which does not exist"):
            module.find_resume_path(ckpt, tmp_path)  # no folder beside it: said before anything is loaded
        (tmp_path / "step-00000004" / "lit_model.pth.scape").mkdir(parents=True)
        assert module.find_resume_path(ckpt, tmp_path) == Path(f"{ckpt}.scape")
        assert module.find_resume_path(Path(f"{ckpt}.scape"), tmp_path) == Path(f"{ckpt}.scape")
    assert module.find_resume_path is litgpt_find
