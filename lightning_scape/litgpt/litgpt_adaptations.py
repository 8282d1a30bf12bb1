"""Every change ``lightning-scape pretrain`` makes around litgpt's pretraining loop, in one place.

``lightning-scape pretrain`` runs ``litgpt.pretrain.main`` as it is; the few places where it reaches into
litgpt's pretraining module, or into what that module calls, are here, one function per adapted attribute.
This is the code a litgpt upgrade is most likely to break: each function's docstring says what litgpt does,
what changes, why, and what of litgpt it relies on. :func:`litgpt_adapted` applies them all for the duration
of a run and restores every attribute when it ends:

- ``litgpt.pretrain.save_hyperparameters``: :func:`save_our_hyperparameters`.
- ``litgpt.pretrain.fit``: :func:`fit_continues_on_world_size`, which calls :func:`continue_on_world_size` to
  rescale the position litgpt saved when the number of processes changed.
- ``litgpt.pretrain.validate``: :func:`validate_outside_clock`.
- ``litgpt.pretrain.save_checkpoint``: :func:`save_checkpoint_outside_clock`, and with the FSDP form
  (:class:`~lightning_scape.ScapeFSDPStrategy`) :func:`save_checkpoint_sharded`.
- ``litgpt.pretrain.find_resume_path``, with the FSDP form: :func:`find_sharded_resume_path`.
- ``torch._dynamo.config.disable``, against the ``torch.compile`` litgpt always applies: :func:`compile_if`.
- ``fabric.print``, against litgpt's closing "Tok/sec" line: :func:`print_without_tok_sec`.

Written for litgpt 0.5 (``pyproject.toml`` allows ``litgpt>=0.5,<0.6``) and checked against litgpt 0.5.13.
``tests/test_pretrain.py`` exercises them alone and through whole runs, ``tests/test_reshard_pretrain.py`` the
resume on another number of processes, ``tests/test_fsdp_pretrain.py`` the FSDP form's saves and resume.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import lightning as L

# The start of the summary line litgpt's ``main`` prints last (see print_without_tok_sec).
TOK_SEC_PREFIX = "| - Tok/sec"


class PausableClock(Protocol):
    """A training clock that time spent inside :meth:`paused` does not advance."""

    def paused(self) -> AbstractContextManager[None]:
        """A context whose duration the clock leaves out."""
        ...


@contextlib.contextmanager
def litgpt_adapted(
    module: Any,
    compile: bool,
    hyperparameters: dict[str, Any] | None,
    data: Any,
    fabric: Any = None,
    clock: PausableClock | None = None,
) -> Iterator[None]:
    """Apply every adaptation of this module to litgpt's pretraining module for the duration of the run.

    Args:
        module: ``litgpt.pretrain`` (tests pass a stand-in with some of its attributes).
        compile: False makes litgpt's ``torch.compile`` a no-op (:func:`compile_if`).
        hyperparameters: This command's parsed arguments, for ``hyperparameters.yaml``; None writes none.
        data: The data module; a ``tokenizer_path`` it names is copied into every checkpoint folder.
        fabric: The run's Fabric; without it, litgpt's "Tok/sec" line is printed as litgpt prints it.
        clock: The command's training clock; without it, ``validate`` and ``save_checkpoint`` stay litgpt's.

    Yields:
        Inside the context, every adaptation holds; all are undone when it ends, even on an error.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(save_our_hyperparameters(module, hyperparameters, data))
        if hasattr(module, "fit"):  # always, in litgpt; a stand-in may leave it out
            stack.enter_context(fit_continues_on_world_size(module))
        stack.enter_context(compile_if(compile))
        if fabric is not None and _is_fsdp_form(fabric) and hasattr(module, "find_resume_path"):
            stack.enter_context(save_checkpoint_sharded(module))
            stack.enter_context(find_sharded_resume_path(module))
        if clock is not None:
            stack.enter_context(validate_outside_clock(module, clock))
            stack.enter_context(save_checkpoint_outside_clock(module, clock))
        if fabric is not None:
            stack.enter_context(print_without_tok_sec(fabric))
        yield


def _is_fsdp_form(fabric: Any) -> bool:
    """Whether the run's strategy is the FSDP form, which saves checkpoint folders."""
    from lightning_scape.fabric.fsdp_strategy import ScapeFSDPStrategy

    return isinstance(getattr(fabric, "strategy", None), ScapeFSDPStrategy)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the context and what it was before once it ends, even on an error."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def save_our_hyperparameters(
    module: Any, hyperparameters: dict[str, Any] | None, data: Any
) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.save_hyperparameters``: write this command's arguments, and the data's tokenizer.

    litgpt: ``save_checkpoint`` calls ``save_hyperparameters(setup, checkpoint_dir)`` on rank 0 for every
    checkpoint folder; it re-parses ``sys.argv`` against the signature of litgpt's own ``setup``.

    Change: ``hyperparameters.yaml`` is written from this command's parsed arguments (nothing when
    ``hyperparameters`` is None), and a ``tokenizer.json`` the data module trained (its ``tokenizer_path``) is
    copied beside it.

    Why: litgpt's ``setup`` does not know the ``scape:`` section or ``lightning-scape``'s own options, so its
    re-parse would fail; with the tokenizer, ``litgpt generate`` can use the checkpoint folder as it is.

    Relies on: the module-level name ``save_hyperparameters``, called with the checkpoint folder second.

    Args:
        module: ``litgpt.pretrain``.
        hyperparameters: This command's parsed arguments; None writes no ``hyperparameters.yaml``.
        data: The data module; its ``tokenizer_path``, when it names a file, is copied.

    Returns:
        The context inside which the adaptation holds.
    """

    def save_hyperparameters(_function: Any, checkpoint_dir: Path, *args: Any, **kwargs: Any) -> None:
        if hyperparameters is not None:
            import yaml

            with open(Path(checkpoint_dir) / "hyperparameters.yaml", "w") as fh:
                yaml.safe_dump(hyperparameters, fh, sort_keys=False)
        tokenizer = getattr(data, "tokenizer_path", None)
        if tokenizer is not None and Path(tokenizer).is_file():
            shutil.copyfile(tokenizer, Path(checkpoint_dir) / "tokenizer.json")

    return _replaced(module, "save_hyperparameters", save_hyperparameters)


def fit_continues_on_world_size(module: Any) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.fit``: rescale litgpt's position first when the number of processes changed.

    litgpt: ``main`` loads the checkpoint to resume (``fabric.load(resume, state)``), then calls ``fit``,
    which starts its loop at ``state["iter_num"]``.

    Change: ``fit`` first calls :func:`continue_on_world_size` on its ``fabric`` and ``state``.

    Why: entering ``fit`` is the one point after the resume and before the loop, where a checkpoint written by
    another number of processes can be made to continue at the same point.

    Relies on: ``main`` calling the module-level ``fit`` with the keyword arguments ``fabric`` and ``state``.

    Args:
        module: ``litgpt.pretrain``.

    Returns:
        The context inside which the adaptation holds.
    """
    litgpt_fit = module.fit

    def fit(*args: Any, **kwargs: Any) -> Any:
        continue_on_world_size(kwargs["fabric"], kwargs["state"])
        return litgpt_fit(*args, **kwargs)

    return _replaced(module, "fit", fit)


def _outside_clock(fn: Any, clock: PausableClock) -> Any:
    """``fn``, with the time spent in it left out of ``clock``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with clock.paused():
            return fn(*args, **kwargs)

    return run


def validate_outside_clock(module: Any, clock: PausableClock) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.validate``: its time does not count as training time.

    litgpt: ``fit`` calls ``validate`` before the loop (a sanity check), every ``eval.interval`` steps and after
    the last step, inside the time litgpt's loop measures.

    Change: the time spent in ``validate`` pauses ``clock``.

    Why: the throughput the command reports at the end is training tokens per second of training.

    Relies on: ``fit`` calling the module-level name ``validate``.

    Args:
        module: ``litgpt.pretrain``.
        clock: The command's training clock.

    Returns:
        The context inside which the adaptation holds.
    """
    return _replaced(module, "validate", _outside_clock(module.validate, clock))


def save_checkpoint_outside_clock(module: Any, clock: PausableClock) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.save_checkpoint``: its time does not count as training time.

    litgpt: ``fit`` calls ``save_checkpoint`` every ``train.save_interval`` steps, and ``main`` once at the end.

    Change: the time spent in ``save_checkpoint`` (writing the model, the optimizer state and SCAPE's
    per-process state) pauses ``clock``.

    Why: as for :func:`validate_outside_clock`, the reported throughput is that of training.

    Relies on: ``fit`` and ``main`` calling the module-level name ``save_checkpoint``.

    Args:
        module: ``litgpt.pretrain``.
        clock: The command's training clock.

    Returns:
        The context inside which the adaptation holds.
    """
    return _replaced(module, "save_checkpoint", _outside_clock(module.save_checkpoint, clock))


def sharded_folder(checkpoint_file: Path) -> Path:
    """The FSDP form's checkpoint folder for litgpt's ``checkpoint_file``: ``lit_model.pth.scape``."""
    return Path(f"{checkpoint_file}.scape")


def save_checkpoint_sharded(module: Any) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.save_checkpoint`` for the FSDP form: a sharded folder, and the whole model beside it.

    litgpt: ``save_checkpoint(fabric, state, tokenizer_dir, checkpoint_file)`` calls ``fabric.save(checkpoint_file,
    state)`` for ``out_dir/step-XXXXXXXX/lit_model.pth`` (and ``out_dir/final/lit_model.pth``), then on rank 0
    writes ``hyperparameters.yaml`` and ``model_config.yaml`` into the same folder. With litgpt's own FSDP strategy
    that one file holds the gathered model, optimizer and loop state.

    Change: with :class:`~lightning_scape.ScapeFSDPStrategy`, litgpt's ``save_checkpoint`` saves ``state`` to the
    folder ``lit_model.pth.scape/`` (:func:`sharded_folder`: one file per rank with its model shard and SCAPE
    state, and ``meta.pt`` with the layout and litgpt's loop state); then the first group gathers the model one
    tensor at a time and rank 0 writes it to ``lit_model.pth`` as ``{"model": state_dict}``.

    Why: the FSDP form's checkpoints are folders (no rank holds the whole optimizer state), and they resume
    bitwise (:func:`find_sharded_resume_path`). The gathered ``lit_model.pth`` keeps every checkpoint folder a
    litgpt checkpoint (``litgpt generate``, ``litgpt convert_from_litgpt``, ``initial_checkpoint_dir`` of a
    DDP-form run); rank 0 holds the whole model in CPU memory while it writes it, as litgpt's own FSDP saves do.

    Relies on: ``save_checkpoint``'s four positional arguments, ``state["model"]`` and the strategy's ``grid``.

    Args:
        module: ``litgpt.pretrain``.

    Returns:
        The context inside which the adaptation holds.
    """
    litgpt_save = module.save_checkpoint

    def save_checkpoint(fabric: Any, state: dict[str, Any], tokenizer_dir: Any, checkpoint_file: Path) -> None:
        litgpt_save(fabric, state, tokenizer_dir, sharded_folder(Path(checkpoint_file)))
        model = _gathered_model(state["model"], first_group=fabric.strategy.grid.replica_index == 0)
        if fabric.global_rank == 0:
            import torch

            torch.save({"model": model}, checkpoint_file)
        fabric.barrier()

    return _replaced(module, "save_checkpoint", save_checkpoint)


def _gathered_model(model: Any, first_group: bool) -> dict[str, Any]:
    """``model``'s whole state dict on the CPU, gathered inside the first group (other groups return ``{}``)."""
    from torch.distributed.tensor import DTensor

    if not first_group:
        return {}
    out = {}
    for name, tensor in model.state_dict().items():
        out[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
    return out


def find_sharded_resume_path(module: Any) -> AbstractContextManager[None]:
    """Adapt ``litgpt.pretrain.find_resume_path`` for the FSDP form: resume from the sharded folder.

    litgpt: ``main`` calls ``find_resume_path(resume, out_dir)``, which returns ``resume`` when it is a path and
    otherwise (``True``, ``"auto"``) the ``out_dir/step-*/*.pth`` of the highest step; ``fabric.load`` loads it.

    Change: a ``.../lit_model.pth`` it returns becomes ``.../lit_model.pth.scape`` (:func:`sharded_folder`), the
    folder :func:`save_checkpoint_sharded` wrote beside it (refused, with the fix, when there is none); a path that
    already names the folder stays.

    Why: the FSDP form loads checkpoint folders, while the user (``--resume out/step-00001000/lit_model.pth``)
    and litgpt's search name litgpt's file. A checkpoint of the DDP form has no ``meta.pt`` in that folder: the
    strategy refuses it, before anything is loaded, saying so.

    Relies on: ``main`` calling the module-level name ``find_resume_path`` and loading what it returns.

    Args:
        module: ``litgpt.pretrain``.

    Returns:
        The context inside which the adaptation holds.
    """
    litgpt_find = module.find_resume_path

    def find_resume_path(resume: Any, out_dir: Path) -> Any:
        path = litgpt_find(resume, out_dir)
        if not path or Path(path).name.endswith(".scape"):
            return path
        folder = sharded_folder(Path(path))
        if not folder.is_dir():
            raise FileNotFoundError(
                f"--resume {path}: the FSDP form resumes from the sharded checkpoint folder {folder}, which does not "
                "exist. Name a lit_model.pth that a run with fsdp.shard_size set saved."
            )
        return folder

    return _replaced(module, "find_resume_path", find_resume_path)


@contextlib.contextmanager
def compile_if(compile: bool) -> Iterator[None]:
    """Adapt litgpt's ``torch.compile``: when ``compile`` is False, make it a no-op.

    litgpt: ``main`` always compiles the model (``model = torch.compile(model)``), whatever the device.

    Change: with ``compile=False``, ``torch._dynamo.config.disable`` is set for the run, so the compiled
    model runs eagerly; with True nothing changes.

    Why: on the CPU, compiling a small model takes longer than a short run trains (``docs/litgpt.md`` has the
    timings), so ``lightning-scape pretrain`` compiles by default only on CUDA.

    Relies on: torch's ``_dynamo.config.disable`` switch, not on litgpt.

    Args:
        compile: Whether litgpt's ``torch.compile`` compiles.

    Yields:
        Inside the context, compilation is as ``compile`` says.
    """
    if compile:
        yield
        return
    import torch._dynamo

    with _replaced(torch._dynamo.config, "disable", True):
        yield


def print_without_tok_sec(fabric: Any) -> AbstractContextManager[None]:
    """Adapt litgpt's closing summary: ``fabric.print`` leaves out its "Tok/sec" line.

    litgpt: at the end of ``main`` it prints ``| - Tok/sec : ...``, the total tokens divided by a
    ``perf_counter`` timestamp rather than by a duration.

    Change: ``fabric.print`` drops the lines that start with :data:`TOK_SEC_PREFIX` and prints every other.

    Why: the number is not a throughput; the command prints its own measurement in its run summary.

    Relies on: the line's prefix, and litgpt printing it through ``fabric.print``.

    Args:
        fabric: The run's Fabric.

    Returns:
        The context inside which the adaptation holds.
    """
    fabric_print = fabric.print

    def print_filtered(*args: Any, **kwargs: Any) -> None:
        if args and str(args[0]).startswith(TOK_SEC_PREFIX):
            return
        fabric_print(*args, **kwargs)

    return _replaced(fabric, "print", print_filtered)


def continue_on_world_size(fabric: L.Fabric, state: dict[str, Any]) -> None:
    """After a resume from a checkpoint written by another number of processes, continue at the same point.

    The SCAPE strategy re-shards its own state when it loads. litgpt's loop, however, counts its position per
    process: ``iter_num`` micro-batches, and the train loader's batches of the epoch, each on every process.
    With the same ``global_batch_size`` and ``micro_batch_size`` the tokens seen so far are ``iter_num x W``
    micro-batches over all processes, so on W' processes the loop resumes at ``iter_num x W / W'`` (the learning
    rate schedule, the end of training and the logged steps then continue where they were), and a
    :class:`~lightning_scape.litgpt.data.ResumableDataLoader` skips ``position x W / W'`` batches of its epoch: the same
    samples, because ``DistributedSampler`` splits one shuffled order of the epoch among the processes. Other
    loaders restore their own state unchanged.

    Relies on: litgpt's ``state`` keys ``iter_num`` and ``train_dataloader`` (the latter wrapped by Fabric, the
    loader in its ``_dataloader``), and the strategy's ``checkpoint_world_size``.

    Args:
        fabric: The run's Fabric, its strategy already loaded from the checkpoint.
        state: litgpt's training state as ``fabric.load`` restored it; updated in place.

    Raises:
        ValueError: When the position is not a whole number of micro-batches on the new number of processes.
    """
    from lightning_scape.litgpt.data import ResumableDataLoader

    saved = getattr(fabric.strategy, "checkpoint_world_size", None)
    world = fabric.world_size
    if saved is None or saved == world:
        return
    loader = state.get("train_dataloader")
    inner = getattr(loader, "_dataloader", loader)
    positions = {"iter_num": int(state["iter_num"])}
    if isinstance(inner, ResumableDataLoader):
        positions["train_dataloader position"] = int(inner.state_dict()["position"])
    for what, value in positions.items():
        if value * saved % world:
            raise ValueError(
                f"The checkpoint was written by {saved} processes at {what}={value} (per process); on {world} "
                f"processes that is {value * saved / world}, not a whole number of micro-batches. Resume on a number "
                f"of processes that divides {value * saved}, with the global_batch_size and micro_batch_size of the "
                "run that wrote it."
            )
    state["iter_num"] = positions["iter_num"] * saved // world
    if isinstance(inner, ResumableDataLoader):
        epoch = inner.state_dict()["epoch"]
        inner.load_state_dict({"epoch": epoch, "position": positions["train_dataloader position"] * saved // world})
    fabric.print(
        f"SCAPE: resumed a checkpoint of {saved} processes on {world}: SCAPE state re-sharded, litgpt continues at "
        f"iteration {state['iter_num']} (was {positions['iter_num']} on {saved} processes)."
    )
