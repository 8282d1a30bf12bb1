"""``lightning-scape pretrain``: recipes, command-line validation, and litgpt's loop end to end on 2 processes."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import rank_file_names

from lightning_scape.config import ScapeConfig
from lightning_scape.examples.workloads import free_port
from lightning_scape.litgpt.pretrain import RecipeError, _rewrite_data_path, check_vocab, parse, pretrain, run_pretrain

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
DEBUG = str(RECIPES / "debug.yaml")

# Recipe -> parameters its model must have (litgpt counts; the names promise the paper's sizes).
EXPECTED_PARAMS = {
    "debug": 857_216,
    "pythia-14m": 14_067_712,
    "pythia-160m": 162_322_944,
    "llama-500m": 518_119_680,
    "llama-1.8b": 1_803_803_904,
    "llama-3-8b": 8_030_261_248,
}


def _params_on_meta(model_config: Any) -> int:
    from litgpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(model_config).parameters())


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_every_recipe_parses_and_builds_its_model(name: str, tmp_path: Path) -> None:
    from litgpt.config import Config

    _, kwargs = parse(["--config", str(RECIPES / f"{name}.yaml"), "--data.cache_dir", str(tmp_path)])
    config = kwargs["model_config"] or Config.from_name(kwargs["model_name"])
    assert _params_on_meta(config) == EXPECTED_PARAMS[name]
    assert isinstance(kwargs["scape"], ScapeConfig) and kwargs["scape"].density == 0.01
    check_vocab(kwargs["data"], config)  # the recipe's tokenizer fits the model's embedding
    assert kwargs["train"].max_steps is None  # litgpt's loop would ignore it
    assert kwargs["precision"] in ("32-true", "bf16-mixed")
    # litgpt's loop stops on tokens: the recipes state their step counts in comments; check the arithmetic.
    seq = config.block_size
    steps = kwargs["train"].max_tokens / (kwargs["train"].global_batch_size * seq)
    warmup = kwargs["scape"].dense_warmup_steps
    assert steps >= 100 and warmup < steps


def test_overrides_and_data_shorthand(tmp_path: Path) -> None:
    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world\n" * 100)
    _, kwargs = parse(
        ["--config", DEBUG, "--scape.density", "0.1", "--train.micro_batch_size", "4", "--data", str(corpus)]
    )
    assert kwargs["scape"].density == 0.1 and kwargs["scape"].dense_warmup_steps == 20  # the rest from the recipe
    assert kwargs["train"].micro_batch_size == 4
    assert Path(kwargs["data"].path) == corpus
    assert _rewrite_data_path(["--data", "TinyStories"]) == ["--data", "TinyStories"]
    assert _rewrite_data_path([f"--data={corpus}"])[-2:] == ["--data.path", str(corpus)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scape.density", "2"], "density=2.0 must lie in (0, 1]"),
        (["--scape.densty", "0.1"], "densty"),
        (["--scape.chunk_size", "1000"], "power of two"),
        (["--train.max_steps", "10"], "--train.max_tokens 20480"),
        (["--train.max_time", "60"], "train.max_time=60.0 cannot be used: litgpt's pretraining loop stops on"),
        (["--train.epochs", "2"], "train.epochs=2 cannot be used"),
        (["--eval.max_new_tokens", "5"], "pretraining generates no text"),
        (["--precision", "bf16-true"], "'bf16-mixed' (GPUs) or '32-true'"),
        (["--model_config.padded_vocab_size", "128", "--model_config.vocab_size", "128"], "at least 256"),
        (["--data", "/no/such/folder"], "/no/such/folder"),
        (["--tokenizer_dir", "/tmp"], "Unset tokenizer_dir"),
        (["--initial_checkpoint_dir", "/no/such/checkpoint"], "initial_checkpoint_dir=/no/such/checkpoint: no such"),
        (["--timeout_s", "0"], "timeout_s=0.0 must be > 0"),
        (["--scape.mask_statistic", "gradient"], "scape.mask_statistic is no option any more: masks always come"),
        (["--scape.collective_timeout_s", "5"], "set the top-level timeout_s (--timeout_s 1800) instead"),
        (["--scape.resume_with_new_config", "true"], "pass the top-level --resume_with_new_config true instead"),
    ],
)
def test_bad_values_exit_2_with_a_message_naming_the_fix(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_pretrain(["--config", DEBUG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-scape pretrain:") and message in err, err


# litgpt's own recipe, config_hub/pretrain/tinystories.yaml (litgpt 0.5; comments and defaults left out): its
# tokenizer_dir is a folder that `litgpt download` fills.
LITGPT_TINYSTORIES = """
model_name: stories15M
model_config: {name: stories15M, hf_config: {}, scale_embeddings: false, block_size: 256, padded_vocab_size: 32000,
  n_layer: 6, n_head: 6, n_query_groups: 6, n_embd: 288, head_size: 48, rotary_percentage: 1.0,
  parallel_residual: false, bias: false, norm_class_name: RMSNorm, mlp_class_name: LLaMAMLP, intermediate_size: 768}
out_dir: out/pretrain/stories15M
precision: bf16-mixed
data: TinyStories
train: {save_interval: 1000, log_interval: 1, global_batch_size: 512, micro_batch_size: 128, lr_warmup_steps: 1000,
  max_tokens: 9700000000, max_seq_length: 256, tie_embeddings: true, max_norm: 1.0, min_lr: 0.0}
eval: {interval: 2000, max_iters: 100, initial_validation: false, final_validation: false}
optimizer: {class_path: torch.optim.AdamW, init_args: {lr: 0.0005, weight_decay: 0.1, betas: [0.9, 0.95]}}
devices: auto
tokenizer_dir: checkpoints/meta-llama/Llama-2-7b-hf
logger_name: csv
seed: 42
"""


def test_litgpts_tinystories_recipe_without_its_tokenizer_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no checkpoints/ folder here
    (tmp_path / "tinystories.yaml").write_text(LITGPT_TINYSTORIES)
    assert run_pretrain(["--config", "tinystories.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-scape pretrain: tokenizer_dir=checkpoints/meta-"), err
    assert "`litgpt download meta-llama/Llama-2-7b-hf --tokenizer_only true`" in err
    (tmp_path / "checkpoints" / "meta-llama" / "Llama-2-7b-hf").mkdir(parents=True)  # downloaded, but empty
    assert run_pretrain(["--config", "tinystories.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no tokenizer.json or tokenizer.model" in err, err


def test_the_summary_says_the_first_step_compiles_only_when_it_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from litgpt.args import TrainArgs

    import lightning_scape.litgpt.pretrain as pretrain_module
    from lightning_scape import AdamS, ScapeEngine, simulate

    def worker(rank: int, comm: Any) -> ScapeEngine:
        model = torch.nn.Linear(64, 64)
        engine = ScapeEngine(
            AdamS(model.parameters()),
            ScapeConfig(density=0.01, dense_warmup_steps=1, density_ramp_steps=0),
            comm,
            sync_params=False,
        )
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            engine.step()
            engine.zero_grad()
        engine.close()
        return engine

    engine = simulate(2, worker)[0]
    now = [0.0]  # the clock reads a counter this test advances: no timing
    monkeypatch.setattr(pretrain_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    for compiled in (False, True):
        printed: list[str] = []
        recipe = types.SimpleNamespace(model_config=types.SimpleNamespace(block_size=16))
        logger = pretrain_module._CommunicationLogger(1, TrainArgs(global_batch_size=4, micro_batch_size=2), recipe)
        logger.fabric = types.SimpleNamespace(  # type: ignore[assignment]
            strategy=types.SimpleNamespace(engine=engine), world_size=2, print=printed.append
        )
        logger.compiled = compiled
        for step in (1, 2, 3):
            logger.clock.step_done(step)
            now[0] += 1.0
        logger.report_total(Path("nowhere"))
        (summary,) = printed
        assert "steps 2-3 over 2.0 s" in summary
        assert ("the first step, which compiles" in summary) == compiled, summary
        assert "steps:         3: 1 dense warm-up (dense_warmup_steps=1), 2 sparse at density 0.01" in summary


def test_a_data_folder_without_text_is_refused_before_launch_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty, binary = tmp_path / "empty", tmp_path / "binary"
    empty.mkdir()
    binary.mkdir()
    (binary / "weights.bin").write_bytes(b"\x00\x01" * 100)
    (binary / "image.png").write_bytes(b"\x89PNG\x00" * 10)
    cases = [("/no/such/folder", "does not exist"), (empty, "no files under"), (binary, "2 skipped as binary")]
    for folder, message in cases:
        assert run_pretrain(["--config", DEBUG, "--data", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lightning-scape pretrain: TextFolder:") and message in err, err
        assert err.count("\n") == 1, err  # one line: no jsonargparse dump, no traceback of a launched rank


def test_resume_with_changed_scape_settings_is_refused_before_launch_naming_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_scape.litgpt.pretrain import check_resume
    from lightning_scape.runtime.checkpoint_protocol import make_stub

    saved = parse(["--config", DEBUG])[1]["scape"]
    ckpt = tmp_path / "out" / "step-00000020" / "lit_model.pth"
    ckpt.parent.mkdir(parents=True)
    full = {"scape": {"world_size": 2, "config": saved.to_dict(), "step_count": 20}, "param_groups": [{"params": [0]}]}
    torch.save({"model": {}, "optimizer": make_stub(full, "id"), "iter_num": 80}, ckpt)
    assert run_pretrain(["--config", DEBUG, "--resume", str(ckpt), "--scape.density", "0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume {ckpt} was written with other SCAPE settings" in err, err
    assert "(--scape.density 0.01)" in err and "--resume_with_new_config true" in err
    check_resume(False, tmp_path, saved)  # no resume: nothing to read
    check_resume(ckpt, tmp_path, saved)  # the same settings, or new ones on purpose: launched
    check_resume(True, tmp_path / "out", saved.replace(density=0.1), resume_with_new_config=True)
    with pytest.raises(RecipeError, match="how the state is laid out"):
        check_resume(ckpt, tmp_path, saved.replace(chunk_size=64), resume_with_new_config=True)


def test_bpe_vocab_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    _, kwargs = parse(["--config", DEBUG, "--data.tokenizer", "bpe", "--data.vocab_size", "4096"])
    with pytest.raises(RecipeError, match=r"padded_vocab_size=256.*at least 4096"):
        pretrain(**kwargs)


def test_help_lists_the_scape_section_and_not_the_refused_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_pretrain(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--scape.density" in out and "--train.max_tokens" in out and "--config" in out
    for refused in ("--train.max_steps", "--train.max_time", "--train.epochs", "--eval.max_new_tokens"):
        assert refused not in out
    # --compile follows the accelerator, and says why it is off on the CPU.
    compile_help = " ".join(out[out.rindex("--compile {") :].split()[:60])
    assert "Default: on with CUDA, off on the CPU, where compiling takes longer" in compile_help, compile_help


@pytest.mark.dist
def test_litgpt_adaptation_writes_our_hyperparameters_and_tokenizer_and_restores_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import torch._dynamo
    import yaml

    import lightning_scape.litgpt.pretrain as pretrain_module
    from lightning_scape.litgpt.litgpt_adaptations import litgpt_adapted
    from lightning_scape.litgpt.pretrain import _Clock

    def litgpt_save(*args: Any) -> None:
        raise AssertionError("litgpt's own hyperparameter capture would re-parse sys.argv")

    module = types.SimpleNamespace(save_hyperparameters=litgpt_save)
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text('{"model": "bpe"}')
    data = types.SimpleNamespace(tokenizer_path=tokenizer)
    before = torch._dynamo.config.disable
    with litgpt_adapted(module, compile=False, hyperparameters={"scape": {"density": 0.01}}, data=data):
        assert torch._dynamo.config.disable is True
        module.save_hyperparameters(object(), tmp_path)
    assert module.save_hyperparameters is litgpt_save and torch._dynamo.config.disable == before
    assert yaml.safe_load((tmp_path / "hyperparameters.yaml").read_text()) == {"scape": {"density": 0.01}}
    assert (tmp_path / "tokenizer.json").read_text() == '{"model": "bpe"}'

    # With a clock and a Fabric: validation pauses the clock, and litgpt's "Tok/sec" line is not printed. The clock
    # reads a counter that this test advances: 3 s of training around 100 s of validation.
    printed: list[str] = []
    now = [0.0]
    monkeypatch.setattr(pretrain_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def validate(*args: Any) -> float:
        now[0] += 100.0
        return 1.0

    module = types.SimpleNamespace(save_hyperparameters=litgpt_save, validate=validate, save_checkpoint=print)
    fabric = types.SimpleNamespace(print=printed.append)
    clock = _Clock()
    with litgpt_adapted(module, compile=True, hyperparameters=None, data=data, fabric=fabric, clock=clock):
        clock.step_done(1)
        now[0] += 1.0
        assert module.validate() == 1.0
        now[0] += 2.0
        clock.step_done(2)
        for line in ("| - Total tokens  : 100", "| - Tok/sec       : 0.01 tok/s", "| - Memory Used   : 1 GB"):
            fabric.print(line)
    assert clock.steps == 1 and clock.seconds == 3.0  # the 100 s of validation left out
    assert printed == ["| - Total tokens  : 100", "| - Memory Used   : 1 GB"]
    assert module.validate is validate and fabric.print == printed.append


# ------------------------------------------------------------------------------- end to end, 2 processes


# The console script pip installed beside this interpreter (the README's entry point).
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "lightning-scape")
MODULE = [sys.executable, "-m", "lightning_scape"]


def _command(out_dir: Path, *args: str, program: list[str] = MODULE) -> list[str]:
    """``program pretrain`` on the debug recipe, 60 steps, shortened logging and evaluation."""
    return [
        *program, "pretrain", "--config", DEBUG, "--out_dir", str(out_dir),
        "--data.max_bytes", "600000", "--train.log_interval", "5", "--train.save_interval", "20",
        "--eval.max_iters", "4", "--train.max_tokens", str(60 * 16 * 128), *args,
    ]  # fmt: skip


def _env(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "LIGHTNING_SCAPE_CACHE": str(cache), "OMP_NUM_THREADS": "1", **extra}


def _pretrain(out_dir: Path, cache: Path, *args: str, program: list[str] = MODULE) -> str:
    """Run the debug recipe on one "node" of 2 processes (the recipe's devices: 2); return its output.

    The second process is started by Lightning re-running this command line, so both entry points
    (``python -m lightning_scape`` and the ``lightning-scape`` console script) must survive that.
    """
    proc = subprocess.run(
        _command(out_dir, *args, program=program),
        env=_env(cache),
        cwd=out_dir.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _pretrain_two_nodes(out_dir: Path, cache: Path) -> None:
    """The same run as 2 "nodes" of 1 process each, joined only through Lightning's environment variables."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            _command(out_dir, "--devices", "1", "--num_nodes", "2"),
            env=_env(cache, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)),
            cwd=out_dir.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-3000:]


def _metrics(out_dir: Path) -> list[dict[str, str]]:
    (path,) = out_dir.glob("logs/csv/**/metrics.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def _final_params(out_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out_dir / "final" / "lit_model.pth", weights_only=True)
    return {k: v for k, v in state["model"].items()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The debug recipe for 60 steps on one node of 2 processes, checkpoints every 20: (out_dir, cache, log).

    Started through the console script; the resume and two-node runs use ``python -m lightning_scape``.
    """
    root = tmp_path_factory.mktemp("pretrain")
    cache, out_dir = root / "cache", root / "full"
    return out_dir, cache, _pretrain(out_dir, cache, program=[CONSOLE_SCRIPT])


@pytest.mark.dist
def test_debug_recipe_trains_logs_and_checkpoints(full_run: tuple[Path, Path, str]) -> None:
    full, _, log = full_run
    # litgpt's loop ran: 60 steps, checkpoints every 20 with SCAPE's per-rank files beside them.
    for step in (20, 40, 60):
        ckpt = full / f"step-{step:08d}" / "lit_model.pth"
        assert ckpt.is_file() and (full / f"step-{step:08d}" / "hyperparameters.yaml").is_file()
        assert rank_file_names(f"{ckpt}.scape") == ["rank-00000.pt", "rank-00001.pt"]
    rows = [r for r in _metrics(full) if r.get("loss")]
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0, losses  # byte-level: from ~5.5 nats to below 3
    # SCAPE's communication is logged through litgpt's logger: dense until step 26 (the warm-up and the ramp's
    # first 6 steps), ~1% of it from step 40, where the ramp ends.
    ratio = "comm/compression_ratio"
    comm = {int(r["step"]): float(r[ratio]) for r in _metrics(full) if r.get(ratio)}
    assert comm[20] == pytest.approx(1.0, rel=0.01) and comm[60] > 50, comm
    assert "Final evaluation | val loss" in log
    # What the command prints: a readable config, the plan, compile off on the CPU, the warm-up named as such.
    assert (
        "SCAPE config: density=0.01, chunk_size=4096, sharded=True, dense_warmup_steps=20, density_ramp_steps=20,"
        in log
    )
    assert "{'density'" not in log and "compile: off" in log
    assert "60 optimizer steps of 2,048 tokens; steps 1-26 are SCAPE's dense warm-up (then the density ramp)" in log
    assert re.search(r"step 5 \| SCAPE sent [\d.]+ kB/step: dense warm-up \(step 5 of 26\)", log), log
    assert " 1.0x fewer" not in log
    assert re.search(r"step 60 \| SCAPE sent [\d.]+ kB/step, [\d.]+x fewer bytes than dense", log), log
    # Its own throughput, per process and in total, instead of litgpt's "Tok/sec" (tokens / a timestamp).
    assert "Tok/sec" not in log
    m = re.search(r"throughput: +([\d,]+) tokens/s in total, ([\d,]+) per process \(2 processes\), steps 2-60", log)
    assert m is not None, log
    total, per_process = (int(g.replace(",", "")) for g in m.groups())
    assert total > 0 and abs(total - 2 * per_process) <= 2
    # The log folder it names holds the comm/ keys; the checkpoint it names exists.
    logs = re.search(r"logs: +(\S+metrics\.csv) \(comm/ keys every 5 steps\)", log)
    assert logs is not None and Path(logs.group(1)).resolve() == next(full.glob("logs/csv/**/metrics.csv")).resolve()
    assert f"checkpoint:    {full / 'final' / 'lit_model.pth'}" in log


@pytest.mark.dist
def test_resume_continues_exactly_where_the_checkpoint_was(full_run: tuple[Path, Path, str], tmp_path: Path) -> None:
    """Resume from step 40 in a fresh folder: litgpt continues at iteration 41 with the same data order,
    learning rate, SCAPE state and masks, and ends at exactly the uninterrupted run's weights."""
    full, cache, _ = full_run
    resumed = tmp_path / "resumed"
    log = _pretrain(resumed, cache, "--resume", str(full / "step-00000040" / "lit_model.pth"))
    assert "Resuming training from" in log
    iters = [int(r["iter"]) for r in _metrics(resumed) if r.get("iter")]
    assert iters and min(iters) == 45 and max(iters) == 60, iters
    _assert_same_weights(_final_params(full), _final_params(resumed))


@pytest.mark.dist
def test_two_nodes_through_lightning_environment_equal_one_node_of_two(
    full_run: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Multi-node needs no code change: NODE_RANK/MASTER_ADDR give the same global ranks, hence the same run."""
    full, cache, _ = full_run
    two_nodes = tmp_path / "two_nodes"
    _pretrain_two_nodes(two_nodes, cache)
    assert rank_file_names(two_nodes / "final" / "lit_model.pth.scape") == [
        "rank-00000.pt",
        "rank-00001.pt",
    ]
    _assert_same_weights(_final_params(full), _final_params(two_nodes))


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_litgpt_extra_holds_what_litgpts_own_command_needs_and_ci_installs_it() -> None:
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # litgpt's `litgpt` command reads configs through jsonargparse's URL support, which needs requests; litgpt
    # declares it only in its heavy [extra].
    assert any(requirement.startswith("requests") for requirement in extras["litgpt"])
    assert set(extras["litgpt"]) <= set(extras["test"])  # CI's environment is a [litgpt] user's: the test below


@pytest.mark.dist  # litgpt's command imports torch, Lightning and litgpt: seconds
def test_litgpts_own_command_runs_where_the_litgpt_extra_is_installed() -> None:
    litgpt = Path(sys.executable).parent / "litgpt"
    for args in (["--help"], ["pretrain", "--help"]):
        proc = subprocess.run([str(litgpt), *args], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0 and "usage: litgpt" in proc.stdout, proc.stderr[-2000:]


def test_config_names_a_shipped_recipe(tmp_path: Path) -> None:
    from lightning_scape.litgpt.pretrain import _resolve_recipe_name, shipped_recipes

    recipes = shipped_recipes()
    assert {"debug", "pythia-14m"} <= set(recipes)
    assert _resolve_recipe_name(["--config", "debug", "--seed", "1"]) == [
        "--config",
        str(recipes["debug"]),
        "--seed",
        "1",
    ]
    assert _resolve_recipe_name(["--config=pythia-14m.yaml"]) == [f"--config={recipes['pythia-14m']}"]
    own = tmp_path / "debug"  # a file of the user's with a recipe's name wins
    own.write_text("model_name: pythia-14m\n")
    assert _resolve_recipe_name(["--config", str(own)]) == ["--config", str(own)]
    with pytest.raises(RecipeError, match=r"not a recipe shipped with lightning-scape .*debug"):
        _resolve_recipe_name(["--config", "no-such-recipe"])
