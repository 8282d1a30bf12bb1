"""``lightning-scape pretrain``: litgpt's own pretraining loop with SCAPE as the Fabric strategy.

litgpt's ``litgpt.pretrain.setup`` hard-codes ``FSDPStrategy``; this module is a replacement for that one
function only. It reads the same YAML recipes and command-line overrides (litgpt's ``pretrain`` arguments
plus a ``scape:`` section), builds ``Fabric(strategy=ScapeStrategy(...))`` with the recipe's accelerator,
devices, nodes and precision, and then calls ``litgpt.pretrain.main``: the training loop, learning-rate
schedule, gradient accumulation, clipping, validation, logging and checkpoints (``out_dir/step-*/lit_model.pth``
and ``out_dir/final``) are litgpt's, unchanged.

Multi-node runs need no change: Lightning's cluster environments (torchrun, SLURM, LSF, ``MASTER_ADDR`` /
``NODE_RANK`` ...) are detected by the strategy as for ``"ddp"``. On one machine with ``devices > 1`` the
command re-runs itself once per extra local process (Lightning's ``popen`` launcher).

What is adapted around litgpt's loop (never inside it) is in :mod:`~lightning_scape.litgpt.litgpt_adaptations`,
one function per litgpt attribute, with the litgpt versions it was checked against. At the end the command
prints its own summary: the training throughput (validation and checkpoint time left out), the bytes sent
against dense data parallelism, the log folder and the checkpoints; litgpt's "Tok/sec" line, which is not a
throughput, is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from litgpt.args import EvalArgs, LogArgs, TrainArgs

from lightning_scape.config import REMOVED_OPTIONS, ScapeConfig
from lightning_scape.litgpt.litgpt_adaptations import litgpt_adapted
from lightning_scape.planning.run_summary import summary_line, summary_lines
from lightning_scape.runtime.options import DEFAULT_TIMEOUT, RunSettings

if TYPE_CHECKING:
    import lightning as L
    from jsonargparse import ArgumentParser
    from litgpt.config import Config
    from litgpt.data import DataModule
    from litgpt.tokenizer import Tokenizer

    from lightning_scape.fabric.fsdp_strategy import ScapeFSDPStrategy
    from lightning_scape.fabric.strategy import ScapeStrategy

# litgpt's own pretraining defaults (``litgpt.pretrain.setup``).
LITGPT_TRAIN_DEFAULTS = TrainArgs(
    save_interval=1000,
    log_interval=1,
    global_batch_size=512,
    micro_batch_size=4,
    max_tokens=int(3e12),
    max_norm=1.0,
    min_lr=4e-5,
    lr_warmup_steps=2000,
    tie_embeddings=False,
)
LITGPT_EVAL_DEFAULTS = EvalArgs(interval=1000, max_iters=100)

# Precisions the SCAPE engine trains in: it updates the parameters in their own dtype, so "*-true" low
# precision would run the error-feedback residual and AdamS in bf16/fp16 (see docs/lightning.md).
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


@dataclasses.dataclass(frozen=True)
class FSDPArgs:
    """The recipe's ``fsdp:`` section: the FSDP form of the strategy (:class:`~lightning_scape.ScapeFSDPStrategy`).

    Args:
        shard_size: Processes that shard one copy of the model between them with FSDP2 (one unit per litgpt
            ``Block``); SCAPE runs across the ``devices x num_nodes / shard_size`` groups. Empty (the default):
            the DDP form, every process holds the whole model. Set it to the GPUs of one node (8) when the model,
            its gradient and SCAPE's state do not fit on one GPU (``docs/fsdp.md``: memory per model size); it
            must divide ``devices x num_nodes``. 1 shards nothing.
    """

    shard_size: int | None = None


class RecipeError(ValueError):
    """A recipe or command-line value that cannot work; raised before any process is launched."""


def pretrain(
    model_name: str | None = None,
    model_config: Config | None = None,
    out_dir: Path = Path("out/pretrain"),
    precision: str | None = None,
    initial_checkpoint_dir: Path | None = None,
    resume: bool | Literal["auto"] | Path = False,
    resume_with_new_config: bool = False,
    data: DataModule | None = None,
    train: TrainArgs = LITGPT_TRAIN_DEFAULTS,
    eval: EvalArgs = LITGPT_EVAL_DEFAULTS,
    log: LogArgs = LogArgs(),  # noqa: B008  # a dataclass default, as in litgpt's own signature
    optimizer: str | dict = "AdamW",
    accelerator: Literal["auto", "cpu", "cuda", "gpu"] = "auto",
    devices: int | str = "auto",
    num_nodes: int = 1,
    tokenizer_dir: Path | None = None,
    logger_name: Literal["csv", "tensorboard", "wandb", "mlflow", "litlogger"] = "csv",
    seed: int = 42,
    scape: ScapeConfig = ScapeConfig(),  # noqa: B008  # frozen
    fsdp: FSDPArgs = FSDPArgs(),  # frozen
    process_group_backend: Literal["nccl", "gloo"] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT.total_seconds(),
    compile: bool | None = None,
    comm_log_interval: int = 0,
    _hyperparameters: dict[str, Any] | None = None,
) -> None:
    """Pretrain a litgpt model with SCAPE sparse data parallelism.

    litgpt's ``pretrain`` arguments (``litgpt pretrain --help``) and SCAPE's: the recipes in ``recipes/`` show all.

    Args:
        model_name: A name from ``litgpt.config`` (``pythia-14m``, ...). Ignored when ``model_config`` is set.
        model_config: A full ``litgpt.Config`` (the Llama-like recipes define their own).
        out_dir: Checkpoints (``step-XXXXXXXX/lit_model.pth`` plus its per-rank ``.scape`` folder) and logs.
        precision: "32-true", "bf16-mixed" (the default on GPUs that support it) or "16-mixed".
        initial_checkpoint_dir: A litgpt checkpoint to start from (continued pretraining).
        resume: A ``lit_model.pth`` to resume from, ``True`` for the latest in ``out_dir``, or ``"auto"``, on any
            ``devices`` / ``num_nodes`` (keep ``global_batch_size`` and ``micro_batch_size``).
        resume_with_new_config: Resume a checkpoint written with other ``scape`` settings (the strategy's argument).
        data: A litgpt ``DataModule``; default: :class:`~lightning_scape.litgpt.data.TextFolder` (offline).
        train: litgpt ``TrainArgs``. The run stops on ``max_tokens``; ``max_steps``, ``max_time`` and ``epochs``,
            which litgpt's pretraining loop ignores or refuses, are refused before launch.
        eval: litgpt ``EvalArgs`` (``max_new_tokens`` is refused: pretraining generates nothing).
        log: litgpt ``LogArgs``.
        optimizer: litgpt's optimizer spec; AdamW/Adam become AdamS, same hyperparameters (or name AdamS).
        accelerator: "cpu", "cuda"/"gpu" or "auto".
        devices: Processes per node ("auto": all GPUs, or 1 on CPU).
        num_nodes: Nodes of the cluster; every node runs ``devices`` processes.
        tokenizer_dir: litgpt tokenizer folder, for data modules that need one (TextFolder trains its own).
        logger_name: Where litgpt's metrics go; "csv" needs nothing installed.
        seed: Seed of the model initialisation and data order.
        scape: The SCAPE section (:class:`~lightning_scape.ScapeConfig`); every field has tuning advice there.
        fsdp: The FSDP form (:class:`FSDPArgs`): ``--fsdp.shard_size 8`` shards the model inside each node.
        process_group_backend: "nccl" or "gloo"; default NCCL on GPUs, gloo on CPU.
        timeout_s: How long any collective may wait, in seconds (the strategy's ``timeout``).
        compile: Compile the model with ``torch.compile``, as litgpt does. Default: on with CUDA, off on the CPU,
            where compiling takes longer than a short run trains (timings of recipes/debug.yaml in docs/litgpt.md).
        comm_log_interval: Every this many optimizer steps, log SCAPE's ``comm/`` keys (0: ``train.log_interval``).
        _hyperparameters: The parsed command line, for each checkpoint's ``hyperparameters.yaml``.
    """
    args = _PretrainArgs(**locals())  # first: every local is an argument
    recipe = _resolve_recipe(args)
    run = _run_settings(timeout_s, resume_with_new_config)
    check_resume(resume, recipe.out_dir, scape, run.resume_with_new_config)
    fabric, comm_logger = _launch_fabric(recipe, args, run)
    _train(fabric, comm_logger, recipe, args)
    comm_logger.report_total(recipe.out_dir)


@dataclasses.dataclass(frozen=True)
class _PretrainArgs:
    """:func:`pretrain`'s arguments as given (each one is described there)."""

    model_name: str | None
    model_config: Config | None
    out_dir: Path
    precision: str | None
    initial_checkpoint_dir: Path | None
    resume: bool | Literal["auto"] | Path
    resume_with_new_config: bool
    data: DataModule | None
    train: TrainArgs
    eval: EvalArgs
    log: LogArgs
    optimizer: str | dict
    accelerator: Literal["auto", "cpu", "cuda", "gpu"]
    devices: int | str
    num_nodes: int
    tokenizer_dir: Path | None
    logger_name: Literal["csv", "tensorboard", "wandb", "mlflow", "litlogger"]
    seed: int
    scape: ScapeConfig
    fsdp: FSDPArgs
    process_group_backend: Literal["nccl", "gloo"] | None
    timeout_s: float
    compile: bool | None
    comm_log_interval: int
    _hyperparameters: dict[str, Any] | None


def _train(fabric: L.Fabric, comm_logger: _CommunicationLogger, recipe: _Recipe, args: _PretrainArgs) -> None:
    """litgpt's pretraining loop (``litgpt.pretrain.main``) on the launched Fabric, with the adaptations around it."""
    from litgpt import pretrain as litgpt_pretrain

    compile = comm_logger.compiled = fabric.device.type == "cuda" if args.compile is None else args.compile
    fabric.print(f"compile: {'on' if compile else 'off'} (torch.compile{'' if compile else ' is a no-op'})")
    with litgpt_adapted(
        litgpt_pretrain,
        compile=compile,
        hyperparameters=args._hyperparameters,
        data=recipe.data,
        fabric=fabric,
        clock=comm_logger.clock,
    ):
        litgpt_pretrain.main(
            fabric=fabric,
            devices=recipe.n_devices,
            num_nodes=args.num_nodes,
            seed=args.seed,
            initial_checkpoint_dir=recipe.initial_checkpoint_dir,
            resume=args.resume,
            config=recipe.model_config,
            data=recipe.data,
            out_dir=recipe.out_dir,
            tokenizer_dir=recipe.tokenizer_dir,
            tokenizer=recipe.tokenizer,
            train=args.train,
            eval=args.eval,
            optimizer=args.optimizer,
        )


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """The recipe's values once resolved and checked: what Fabric and litgpt's loop are built from."""

    model_config: Config
    data: DataModule
    precision: str  # one of PRECISIONS
    initial_checkpoint_dir: Path | None
    tokenizer_dir: Path | None
    n_devices: int
    out_dir: Path
    tokenizer: Tokenizer | None  # loaded from tokenizer_dir


def _resolve_recipe(args: _PretrainArgs) -> _Recipe:
    """Fill in the defaults of :func:`pretrain`'s arguments and refuse what cannot work, before any launch.

    Raises:
        RecipeError: No or an unknown model, one of :data:`REFUSED_OPTIONS` set, ``tokenizer_dir`` with a
            TextFolder, token ids the model's embedding cannot hold, or a precision SCAPE does not train in.
    """
    from litgpt.utils import extend_checkpoint_dir, init_out_dir, parse_devices

    model_config = _model_config(args.model_name, args.model_config)
    _refuse_ignored(args.train, model_config, args.eval)
    data = _data_module(args.data, args.tokenizer_dir)
    check_vocab(data, model_config)
    initial_checkpoint_dir, tokenizer_dir = (
        None if d is None else extend_checkpoint_dir(d) for d in (args.initial_checkpoint_dir, args.tokenizer_dir)
    )
    precision = default_precision(args.accelerator) if args.precision is None else args.precision
    check_precision(precision)
    devices, accelerator = args.devices, args.accelerator
    n_devices = parse_devices(devices) if accelerator != "cpu" or devices != "auto" else 1
    out_dir = init_out_dir(args.out_dir)
    tokenizer = _tokenizer(tokenizer_dir) if tokenizer_dir is not None else None
    if initial_checkpoint_dir is not None and not initial_checkpoint_dir.is_dir():
        raise RecipeError(
            f"initial_checkpoint_dir={initial_checkpoint_dir}: no such folder. Point it at a litgpt checkpoint folder "
            "(litgpt download ORG/NAME writes one under checkpoints/), or leave it empty to start from scratch."
        )
    return _Recipe(
        model_config=model_config,
        data=data,
        precision=precision,
        initial_checkpoint_dir=initial_checkpoint_dir,
        tokenizer_dir=tokenizer_dir,
        n_devices=n_devices,
        out_dir=out_dir,
        tokenizer=tokenizer,
    )


def _tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """litgpt's tokenizer from ``tokenizer_dir``, or a :class:`RecipeError` saying what to do when it has none.

    litgpt's own recipes (``tinystories.yaml``: ``checkpoints/meta-llama/Llama-2-7b-hf``) name a folder that
    ``litgpt download`` fills; without it litgpt stops with a traceback after the data module is built.
    """
    from litgpt.tokenizer import Tokenizer

    hint = (
        f"Fetch it with `litgpt download {tokenizer_dir.relative_to('checkpoints')} --tokenizer_only true`, "
        if tokenizer_dir.parts[:1] == ("checkpoints",) and len(tokenizer_dir.parts) == 3
        else "Point tokenizer_dir at the folder of the tokenizer the data was prepared with, "
    )
    if not tokenizer_dir.is_dir():
        raise RecipeError(
            f"tokenizer_dir={tokenizer_dir}: no such folder (the data module reads its tokenizer there). {hint}"
            "or train on text of your own with --data PATH --tokenizer_dir null (TextFolder trains its own tokenizer)."
        )
    try:
        return Tokenizer(tokenizer_dir)
    except NotImplementedError:  # litgpt's words for "neither tokenizer.json nor tokenizer.model"
        raise RecipeError(
            f"tokenizer_dir={tokenizer_dir} holds no tokenizer.json or tokenizer.model. {hint}or point it at a "
            "folder that does."
        ) from None


def _model_config(model_name: str | None, model_config: Config | None) -> Config:
    """``model_config`` if set, else litgpt's config named ``model_name``."""
    from litgpt.config import Config

    if model_config is not None:
        return model_config
    if model_name is None:
        raise RecipeError("Set model_name (a litgpt config name, e.g. pythia-14m) or model_config in the recipe.")
    try:
        return Config.from_name(model_name)
    except ValueError as exc:
        raise RecipeError(
            f"model_name={model_name!r} is not a litgpt config name ({exc}). Run `litgpt pretrain list` for "
            "the names, or define model_config in the recipe."
        ) from exc


# Options of litgpt's argument classes that its pretraining loop ignores or refuses: refused before launch
# and left out of --help. (litgpt 0.5: the loop stops on train.max_tokens; validate_args refuses the others.)
REFUSED_OPTIONS: dict[str, str] = {
    "train.max_steps": "litgpt's pretraining loop stops on train.max_tokens and would ignore it",
    "train.max_time": "litgpt's pretraining loop stops on train.max_tokens and would ignore it",
    "train.epochs": "litgpt's pretraining loop stops on train.max_tokens and refuses it",
    "eval.max_new_tokens": "pretraining generates no text",
}


def _refuse_ignored(train: TrainArgs, model_config: Config, eval: EvalArgs | None = None) -> None:
    """Refuse the :data:`REFUSED_OPTIONS` that are set; for ``max_steps``, give the ``max_tokens`` that stops there."""
    if train.max_steps is not None:
        seq = train.max_seq_length or model_config.block_size
        raise RecipeError(
            f"train.max_steps={train.max_steps} would be ignored: litgpt's pretraining loop stops on "
            f"train.max_tokens. Unset max_steps and set --train.max_tokens "
            f"{train.max_steps * train.global_batch_size * seq} (= max_steps x global_batch_size x {seq} tokens)."
        )
    values = {"train.max_time": train.max_time, "train.epochs": train.epochs}
    if eval is not None:
        values["eval.max_new_tokens"] = eval.max_new_tokens
    for name, value in values.items():
        if value is not None:
            raise RecipeError(f"{name}={value} cannot be used: {REFUSED_OPTIONS[name]}. Unset it; the run stops on "
                              "train.max_tokens.")  # fmt: skip


def _data_module(data: DataModule | None, tokenizer_dir: Path | None) -> DataModule:
    """``data``, by default a TextFolder on the standard library's sources; refuse a tokenizer it would ignore."""
    from lightning_scape.litgpt.data import TextFolder

    if data is None:
        data = TextFolder()
    if tokenizer_dir is not None and isinstance(data, TextFolder):
        raise RecipeError(
            "tokenizer_dir is set, but the TextFolder data module trains its own tokenizer (data.init_args."
            "tokenizer: byte or bpe). Unset tokenizer_dir, or use a litgpt data module that takes a tokenizer."
        )
    if isinstance(data, TextFolder):
        try:
            data.check_text()
        except (OSError, ValueError) as exc:  # missing, empty, binary-only or unreadable: one line, before launch
            raise RecipeError(str(exc)) from None
    return data


def _launch_fabric(recipe: _Recipe, args: _PretrainArgs, run: RunSettings) -> tuple[L.Fabric, _CommunicationLogger]:
    """Fabric with the SCAPE strategy, litgpt's logger and the communication logger, launched on every process."""
    import lightning as L
    from litgpt.utils import choose_logger

    logger = choose_logger(
        args.logger_name,
        recipe.out_dir,
        name=f"pretrain-{recipe.model_config.name}",
        resume=bool(args.resume),
        log_interval=args.train.log_interval,
        log_args=dataclasses.asdict(args.log),
    )
    comm_logger = _CommunicationLogger(args.comm_log_interval or args.train.log_interval, args.train, recipe)
    strategy = _strategy(recipe, args.num_nodes, args.scape, args.fsdp, args.process_group_backend, run)
    strategy.log_run_summary = False  # its lines are in the command's own summary (report_total)
    fabric = L.Fabric(
        accelerator=args.accelerator,
        devices=recipe.n_devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=recipe.precision,  # type: ignore[arg-type]  # one of PRECISIONS, checked by _resolve_recipe
        loggers=[logger],
        callbacks=[comm_logger],
    )
    fabric.launch()
    comm_logger.fabric = fabric
    fabric.print(f"SCAPE config: {config_line(args.scape)}")
    planned = comm_logger.planned_steps(fabric.world_size)
    warmup = args.scape.dense_steps
    fabric.print(
        f"{planned} optimizer steps of {comm_logger.tokens_per_step(fabric.world_size):,} tokens"
        + (f"; steps 1-{min(warmup, planned)} are SCAPE's dense warm-up (then the density ramp)" if warmup else "")
    )
    strategy.warn_if_all_dense(planned, syntax="cli")  # warns once the model is set up, if the schedule misfits
    log_dir = getattr(logger, "log_dir", None)
    if log_dir is not None:
        comm_logger.log_dir = Path(log_dir)
        fabric.print(f"logs: {log_dir} (litgpt's metrics and SCAPE's comm/ keys)")
    if args._hyperparameters is not None and args.logger_name in ("tensorboard", "wandb", "mlflow"):
        fabric.logger.log_hyperparams(args._hyperparameters)
    return fabric, comm_logger


def _run_settings(timeout_s: float, resume_with_new_config: bool) -> RunSettings:
    """The strategy's settings from the command line's ``timeout_s`` and ``resume_with_new_config``."""
    if not timeout_s > 0:
        raise RecipeError(f"timeout_s={timeout_s} must be > 0 (seconds a collective may wait; default 1800).")
    return RunSettings.of(timedelta(seconds=timeout_s), resume_with_new_config)


def _strategy(
    recipe: _Recipe,
    num_nodes: int,
    scape: ScapeConfig,
    fsdp: FSDPArgs,
    process_group_backend: Literal["nccl", "gloo"] | None,
    run: RunSettings,
) -> ScapeStrategy | ScapeFSDPStrategy:
    """The DDP form, or with ``fsdp.shard_size`` set the FSDP form with litgpt's ``Block`` as the FSDP unit.

    Raises:
        RecipeError: A ``shard_size`` that does not divide the processes, or an option the FSDP form cannot run.
    """
    from lightning_scape.fabric import fsdp_strategy, strategy

    if fsdp.shard_size is None:
        return strategy.ScapeStrategy(
            config=scape,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=run.timeout_s),
            resume_with_new_config=run.resume_with_new_config,
        )
    from litgpt.model import Block

    world = recipe.n_devices * num_nodes
    if fsdp.shard_size < 1 or world % fsdp.shard_size:
        raise RecipeError(
            f"fsdp.shard_size={fsdp.shard_size} must be a divisor of the {world} processes (devices={recipe.n_devices}"
            f" x num_nodes={num_nodes}): set it to the processes of one node, or leave it empty for the DDP form."
        )
    if recipe.precision == "16-mixed":
        raise RecipeError("The FSDP form (fsdp.shard_size) trains in '32-true' or 'bf16-mixed', not '16-mixed'.")
    if recipe.initial_checkpoint_dir is not None:
        raise RecipeError(
            "initial_checkpoint_dir cannot be loaded into the FSDP form's sharded model. Continue from it with the "
            "DDP form (leave fsdp.shard_size empty), or resume an FSDP-form run with --resume."
        )
    return fsdp_strategy.ScapeFSDPStrategy(
        shard_size=fsdp.shard_size,
        auto_wrap_policy={Block},
        process_group_backend=process_group_backend,
        timeout=timedelta(seconds=run.timeout_s),
        resume_with_new_config=run.resume_with_new_config,
        config=scape,
    )


def config_line(config: ScapeConfig) -> str:
    """The SCAPE configuration on one line, ``name=value`` for every field (the recipe's ``scape:`` keys)."""

    def value(v: Any) -> str:
        return f"{v:g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{name}={value(v)}" for name, v in config.to_dict().items())


def default_precision(accelerator: str) -> str:
    """bf16-mixed where a CUDA GPU supports bf16 and will be used, else 32-true."""
    if accelerator != "cpu" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def check_precision(precision: str) -> None:
    """Refuse the precisions the SCAPE strategy does not train in, saying what to use instead."""
    if precision not in PRECISIONS:
        raise RecipeError(
            f"precision={precision!r} is not supported by SCAPE pretraining: the error-feedback residual and "
            "AdamS would run in low precision. Use 'bf16-mixed' (GPUs) or '32-true'."
        )


def check_resume(
    resume: bool | Literal["auto"] | Path, out_dir: Path, scape: ScapeConfig, resume_with_new_config: bool = False
) -> None:
    """Refuse, before launch, a ``--resume`` checkpoint written with other SCAPE settings than ``scape``.

    Reads only the checkpoint's SCAPE stub (the file is memory-mapped); a checkpoint that cannot be read here
    is left to the load after launch, which says why.
    """
    from litgpt.utils import find_resume_path

    from lightning_scape.engine.state import check_config, config_changes
    from lightning_scape.runtime.checkpoint_protocol import is_scape_stub

    try:
        path = find_resume_path(resume, out_dir)
    except FileNotFoundError as exc:
        raise RecipeError(str(exc)) from None
    if not path:  # litgpt hands back resume=False itself
        return
    if not Path(path).is_file():
        raise RecipeError(f"--resume {path}: no such checkpoint file (litgpt's out_dir/step-*/lit_model.pth).")
    try:
        stub = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("optimizer")
    except Exception:  # unreadable or not a dict: the load after launch names the problem
        return
    if not is_scape_stub(stub):
        return
    try:
        check_config(scape, stub["scape_checkpoint"]["config"], resume_with_new_config)
    except ValueError as exc:
        if resume_with_new_config:
            raise RecipeError(f"--resume {path}: {exc}") from None
        changes = config_changes(scape, stub["scape_checkpoint"]["config"])
        again = {k: old for k, (old, _) in changes.items() if k not in REMOVED_OPTIONS}
        saved = " ".join(f"--scape.{k} {_flag(old)}" for k, old in again.items())
        removed = sorted(set(changes) - set(again))
        advice = f"pass them again ({saved}) to continue as it was, or " if not removed else ""
        raise RecipeError(
            f"--resume {path} was written with other SCAPE settings"
            + (f" (among them {removed}, which this version no longer has)" if removed else "")
            + f"; {advice}add --resume_with_new_config true to carry its weights, momentum and residuals into the "
            "new settings (the masks are rebuilt)."
        ) from None


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_vocab(data: Any, model_config: Config) -> None:
    """The data's token ids must fit the model's embedding; say which number to change when they do not."""
    bound = getattr(data, "vocab_size_bound", None)
    if bound is not None and bound > model_config.padded_vocab_size:
        raise RecipeError(
            f"The data module produces token ids up to {bound - 1}, but the model's embedding has "
            f"padded_vocab_size={model_config.padded_vocab_size}. Set model_config.padded_vocab_size (and "
            f"vocab_size) to at least {bound}, or lower data.init_args.vocab_size."
        )


class _Clock:
    """Training time: from the end of the first optimizer step to the end of the last, less validation and saving.

    The first step is left out because it compiles (``torch.compile``) and warms the allocator; validation
    and checkpoints are not training.
    """

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._t0 = 0.0
        self._t_last = 0.0
        self._paused_s = 0.0
        self._paused_at_last = 0.0

    def step_done(self, step: int) -> None:
        """An optimizer step (the engine's count) just ended."""
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step, self._t0 = step, now
            self._paused_s = 0.0
        self.last_step, self._t_last, self._paused_at_last = step, now, self._paused_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count (validation, checkpoints)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - t0

    @property
    def steps(self) -> int:
        """Optimizer steps timed (all but the first)."""
        return 0 if self.first_step is None or self.last_step is None else self.last_step - self.first_step

    @property
    def seconds(self) -> float:
        """Training seconds of the timed steps."""
        return self._t_last - self._t0 - self._paused_at_last


class _CommunicationLogger:
    """A Fabric callback: SCAPE's bytes per step, logged through litgpt's logger every ``interval`` steps, and
    the run's throughput and bytes at the end."""

    def __init__(self, interval: int, train: TrainArgs, recipe: _Recipe) -> None:
        from lightning_scape.pytorch.monitors import CommunicationMonitor

        self.interval = max(1, interval)
        self.monitor = CommunicationMonitor(per_kind=False, progress_bar=False)
        self.fabric: L.Fabric | None = None
        self.train = train
        self.seq_len = train.max_seq_length or recipe.model_config.block_size
        self.clock = _Clock()
        self.log_dir: Path | None = None
        self.compiled = False  # whether the first step compiled the model (pretrain's compile)

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens of one optimizer step, all processes together (what litgpt's loop consumes)."""
        return self.train.global_batch_size // world_size * world_size * self.seq_len

    def planned_steps(self, world_size: int) -> int:
        """The optimizer steps litgpt's loop will take: it stops on ``train.max_tokens``."""
        assert self.train.max_tokens is not None
        micro = self.train.micro_batch_size
        iters = self.train.max_tokens // world_size // (micro * self.seq_len)
        return iters // max(1, self.train.global_batch_size // world_size // micro)

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Fabric hook (every rank): record the step; every ``interval`` steps log and print the window."""
        self.monitor.on_after_optimizer_step(strategy=strategy, optimizer=optimizer)
        engine = getattr(strategy, "engine", None)
        if engine is None:
            return
        self.clock.step_done(engine.step_count)
        c = engine.counters
        # The engine's step count survives a resume, so the logged steps continue where the checkpoint was.
        if engine.step_count % self.interval != 0 or self.fabric is None:
            return
        metrics = self.monitor.compute()  # every rank: the wait-time keys all-gather across ranks
        self.fabric.log_dict(metrics, step=engine.step_count)
        warmup, step = engine.config.dense_steps, engine.step_count
        sent = f"step {step} | SCAPE sent {metrics['comm/sent_bytes'] / 1e3:.1f} kB/step"
        if c.total_dense_equivalent == 0:  # one process per replica group: nothing to compare with
            self.fabric.print(f"{sent}: one replica, so nothing to communicate")
            return
        if step <= warmup:
            self.fabric.print(f"{sent}: dense warm-up (step {step} of {warmup}), as much as dense data parallelism")
            return
        mixed = " (this window includes dense warm-up steps)" if step - self.interval < warmup else ""
        self.fabric.print(
            f"{sent}, {metrics['comm/compression_ratio']:.1f}x fewer bytes than dense data parallelism{mixed}"
        )

    def report_total(self, out_dir: Path) -> None:
        """Print the run's summary: throughput, and the strategy's (bytes against dense data parallelism, time
        waiting on collectives, steps of each phase), then where the logs and checkpoints are."""
        if self.fabric is None:
            return
        engine = getattr(self.fabric.strategy, "engine", None)
        if engine is None:
            return
        fabric, clock = self.fabric, self.clock
        world = fabric.world_size
        lines = ["SCAPE run summary"]
        first, last = clock.first_step, clock.last_step
        if first is not None and last is not None and last > first and clock.seconds > 0:
            total = clock.steps * self.tokens_per_step(world) / clock.seconds
            first_step = "the first step, which " + ("compiles" if self.compiled else "does one-time set-up")
            lines.append(
                summary_line(
                    "throughput",
                    f"{total:,.0f} tokens/s in total, {total / world:,.0f} per process ({world} processes), steps "
                    f"{first + 1}-{last} over {clock.seconds:.1f} s ({first_step}, and validation and checkpoint "
                    "time left out)",
                )
            )
        from lightning_scape.fabric.fsdp_strategy import ScapeFSDPStrategy

        baseline = "HSDP" if isinstance(fabric.strategy, ScapeFSDPStrategy) else "DDP"
        lines += summary_lines(engine, baseline)
        self._report_paths(lines, out_dir)

    def _report_paths(self, lines: list[str], out_dir: Path) -> None:
        """Print the summary ``lines`` with where the logs and the final checkpoint are."""
        assert self.fabric is not None
        if self.log_dir is not None:
            csv_file = self.log_dir / "metrics.csv"
            where = csv_file if csv_file.exists() else self.log_dir
            lines.append(summary_line("logs", f"{where} (comm/ keys every {self.interval} steps)"))
        final = out_dir / "final" / "lit_model.pth"
        if final.exists():
            lines.append(summary_line("checkpoint", f"{final} (SCAPE's per-process state in {final.name}.scape/)"))
        self.fabric.print("\n".join(lines))


# ----------------------------------------------------------------------------------------- command line


def build_parser() -> ArgumentParser:
    """The ``lightning-scape pretrain`` argument parser: :func:`pretrain`'s signature plus ``--config``."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="lightning-scape pretrain",
        description="Pretrain a litgpt model with SCAPE sparse data parallelism (litgpt's loop, SCAPE strategy).",
        exit_on_error=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A recipe: YAML in litgpt's pretrain format.")
    parser.add_function_arguments(pretrain, skip={"_hyperparameters"})
    # Refused before launch (REFUSED_OPTIONS): parsed, so that the error can say why, but not advertised.
    for action in parser._actions:  # the argument groups' actions included
        if action.dest in REFUSED_OPTIONS:
            action.help = argparse.SUPPRESS
    return parser


def _rewrite_data_path(argv: list[str]) -> list[str]:
    """``--data PATH`` (a folder or file that exists) means ``--data.path PATH`` of the TextFolder data module."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value: str | None = None
        if arg == "--data" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--data="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        if os.path.exists(value) or os.sep in value:
            out += ["--data", "lightning_scape.litgpt.data.TextFolder", "--data.path", value]
        else:
            out += ["--data", value]
    return out


def shipped_recipes() -> dict[str, Path]:
    """The recipes installed with the package (the repository's ``recipes/``), by name (``debug``, ...)."""
    folder = Path(__file__).resolve().parent.parent / "recipes"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def _resolve_recipe_name(argv: list[str]) -> list[str]:
    """``--config NAME`` (no such file, and no path separator) names a shipped recipe: ``--config debug``."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            at, value = i + 1, out[i + 1]
        elif arg.startswith("--config="):
            at, value = i, arg.split("=", 1)[1]
        else:
            continue
        if os.path.exists(value) or os.sep in value:
            continue
        recipes = shipped_recipes()
        name = value.removesuffix(".yaml")
        if name not in recipes:
            raise RecipeError(
                f"--config {value}: no such file, and not a recipe shipped with lightning-scape "
                f"({', '.join(recipes)}). Pass a recipe's path or one of these names."
            )
        out[at] = str(recipes[name]) if at == i + 1 else f"--config={recipes[name]}"
    return out


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse the command line.

    Returns:
        The parsed configuration as plain data (what ``hyperparameters.yaml`` records) and :func:`pretrain`'s
        keyword arguments, ``_hyperparameters`` included.
    """
    import yaml

    parser = build_parser()
    cfg = parser.parse_args(_rewrite_data_path(_resolve_recipe_name(argv)))
    init = parser.instantiate_classes(cfg)
    hyperparameters = yaml.safe_load(parser.dump(cfg, format="yaml", skip_none=False))
    kwargs = {k: v for k, v in vars(init).items() if k != "config"}
    kwargs["_hyperparameters"] = hyperparameters
    return hyperparameters, kwargs


def run_pretrain(argv: list[str]) -> int:
    """``lightning-scape pretrain --config NAME [--train.max_tokens 1000000 ...]``.

    ``NAME`` is a recipe's path, or the name of a recipe shipped with the package (``debug``, ``pythia-14m``, ...).
    """
    from jsonargparse import ArgumentError

    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    try:
        _, kwargs = parse(argv)
    except (ArgumentError, ValueError, TypeError) as exc:  # RecipeError is a ValueError
        print(f"lightning-scape pretrain: {_parse_error(exc)}", file=sys.stderr)
        return 2
    try:
        pretrain(**kwargs)
    except RecipeError as exc:
        print(f"lightning-scape pretrain: {exc}", file=sys.stderr)
        return 2
    return 0


def _parse_error(exc: BaseException) -> str:
    """The message of a command-line error: the data module's own line where jsonargparse wraps it.

    jsonargparse reports a data module that refused its arguments (``TextFolder: path ... does not exist``)
    inside a dump of the union's subtypes and the namespace it was given; the user needs that one line.
    """
    for line in str(exc).splitlines():
        line = line.strip().removeprefix("- ")
        if line.startswith(("TextFolder:", "Invalid TextFolder:")):
            return line
    for name in REMOVED_OPTIONS:
        if re.search(rf"\bscape\.{name}\b|'{name}'", str(exc)):
            return f"scape.{name} is no option any more: {_CLI_REPLACEMENTS.get(name, REMOVED_OPTIONS[name][1])}."
    return str(exc)


# What replaces an option of an earlier version on the command line, where it is not what REMOVED_OPTIONS says.
_CLI_REPLACEMENTS = {
    "collective_timeout_s": "set the top-level timeout_s (--timeout_s 1800) instead",
    "resume_with_new_config": "pass the top-level --resume_with_new_config true instead",
}
