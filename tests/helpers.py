"""What several test modules share: equality, the tiny net and its data, a text corpus, process launching,
the engine's reference runs, and the registry of the strategy tests' multi-process scenarios.

Sections: equality; the tiny net; a text corpus; processes (gloo groups, worker scripts, saved outputs);
the engine on the tiny net (``test_engine``, ``test_engine_dist``); the strategies on the tiny net
(``test_strategy_trainer``, ``test_strategy_fabric``, ``test_monitors``, ``test_runtime``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.examples.workloads import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable

# ----------------------------------------------------------------------------------------- equality


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of tensors, recursively through lists, tuples and dicts; ``==`` for anything else."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def rel_err(a: Tensor, b: Tensor) -> float:
    """``|a - b| / |b|`` (Euclidean norms)."""
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------- the tiny net

IN, HID, OUT = 24, 40, 8


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Three linear layers 24-40-8 (about 2.6k parameters), identical for a given seed."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net.to(dtype)


def random_batch(seed: int, rows: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Inputs ``(rows, IN)`` and targets ``(rows, OUT)`` for the tiny net, normal and fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g)
    y = torch.randn(rows, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def param_groups(net: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Weights with decay 0.1; biases without decay and at half the learning rate (as LLM recipes group them)."""
    named = list(net.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": lr * 0.5},
    ]


def flat(params: Iterable[Tensor]) -> Tensor:
    """Parameters as one fp64 vector, in the given order."""
    return torch.cat([p.detach().reshape(-1).double() for p in params])


# ------------------------------------------------------------------------------------ a text corpus

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "lambda", "sigma", "omega", "tensor", "sparse"]


def write_corpus(folder: Path, n_files: int, words: int = 200, seed: int = 0) -> dict[str, bytes]:
    """``n_files`` distinct text files of random words (every tenth in a subfolder); returns relative path ->
    content."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n_files):
        rel = f"sub/doc{i:03d}.txt" if i % 10 == 3 else f"doc{i:03d}.txt"
        text = f"document {i} ({rel}): " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"
        files[rel] = text.encode()
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(files[rel])
    return files


# ---------------------------------------------------------------------------------------- processes


def _gloo_entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_gloo(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined by a gloo process group (CPU);
    their results by rank. ``fn`` must be importable (a module-level function)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_gloo_entry, args=(r, world_size, port, fn, args, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        if alive:
            raise TimeoutError(f"gloo workers did not finish within {timeout_s}s")
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise RuntimeError(f"gloo workers failed with exit codes {codes}")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for worker processes: one thread, no stray distributed variables, ``tests/`` and the
    repository's root (``benchmarks``) importable, and Python's fault handler on (a process that aborts prints
    every thread's stack)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("MASTER_", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC", "PL_", "SLURM")
        )
    }
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def run_script(
    args: list[str], timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` in ``tests/``; fail with its output when it does not exit 0."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [PYTHON, *args], env=env or child_env(), capture_output=True, text=True, timeout=timeout_s, cwd=HERE
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{args} exited {proc.returncode} after {time.perf_counter() - t0:.1f}s\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def survivor_outcome(
    survivor: subprocess.Popen[str], victim: subprocess.Popen[str], timeout_s: float
) -> dict[str, Any]:
    """The surviving node's exit code and output once it ends (killed after ``timeout_s``: its code is then
    negative), and the victim node killed, whatever state it is in."""
    try:
        output, _ = survivor.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        survivor.kill()
        output, _ = survivor.communicate()
    victim.kill()
    victim.wait()
    return {"returncode": survivor.returncode, "output": output}


def save_output(outdir: str, name: str, rank: int, obj: Any) -> None:
    """Save what rank ``rank`` of a scenario produced, as ``<outdir>/<name>_rank<rank>.pt``."""
    torch.save(obj, os.path.join(outdir, f"{name}_rank{rank}.pt"))


@contextlib.contextmanager
def rank_zero_messages() -> Iterator[list[str]]:
    """The messages ``rank_zero_info`` logs inside (none on ranks other than 0): the strategies' start-up line and
    end-of-run summary. They go to the logger that ``lightning_utilities`` holds (Fabric's or the Trainer's)."""
    import lightning_utilities.core.rank_zero as rank_zero

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = rank_zero.log, Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def load_outputs(outdir: str, name: str, world_size: int = 2) -> list[Any]:
    """What each rank saved under ``name`` (:func:`save_output`), by rank."""
    return [torch.load(os.path.join(outdir, f"{name}_rank{r}.pt"), weights_only=False) for r in range(world_size)]


def rank_file(checkpoint: str | Path, rank: int) -> str:
    """The one SCAPE rank file of ``rank`` beside ``checkpoint`` (``<checkpoint>.scape/<save id>-rank-XXXXX.pt``)."""
    (found,) = Path(f"{checkpoint}.scape").glob(f"*-rank-{rank:05d}.pt")
    return str(found)


def rank_file_names(directory: str | Path) -> list[str]:
    """The names in ``directory``, sorted, with the save id of every rank file left out (``rank-XXXXX.pt``)."""
    return sorted(re.sub(r"^.+-(rank-\d{5}\.pt)$", r"\1", name) for name in os.listdir(directory))


# ----------------------------------------------------------------------- the engine on the tiny net


def make_batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """16 rank- and step-specific samples."""
    return random_batch(1000 * step + rank + 7, 16, dtype)


def run_worker(rank: int, comm: Communicator, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a deterministic engine run on the tiny net (same model everywhere, rank-specific data):
    ``spec["steps"]`` steps of ``ScapeConfig(**spec["config"])``; returns per-step parameters, byte counters and
    masks, and the final layout (per bucket: padded size and chunk size) and residuals."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    cfg = ScapeConfig(**spec["config"])
    model = make_net(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    engine = ScapeEngine(opt, cfg, comm, param_order=list(model.parameters()))
    engine.masks.statistic = spec.get("statistic", "momentum")  # "gradient": the benchmarks' baseline
    out: dict[str, Any] = {"params": [], "sent": [], "dense_eq": [], "masks_used": [], "masks_built": []}
    for step in range(spec["steps"]):
        x, y = make_batch(rank, step, dtype)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_used"].append([m.clone() for m in engine.current_masks()])
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        engine.step(max_grad_norm=spec.get("max_grad_norm"))
        engine.zero_grad()
        out["params"].append(flat(model.parameters()))
        out["sent"].append(dict(engine.counters.step_sent))
        out["dense_eq"].append(engine.counters.step_dense_equivalent)
        if not engine.in_warmup and cfg.mask_delay > 0:
            out["masks_built"].append([m.clone() for m in engine.last_built_masks()])
    out["padded_numel"] = engine.padded_numel
    out["numel"] = engine.numel
    out["slots"] = engine.slots
    out["layout"] = [(bs.layout.padded_numel, bs.layout.chunk_size) for bs in engine.buckets]
    out["residual"] = [bs.residual.clone() for bs in engine.buckets]
    engine.close()
    return out


def reference_dense_adams(spec: dict[str, Any], world_size: int) -> list[Tensor]:
    """What :func:`run_worker` must reproduce at density 1: data-parallel AdamS in one process (average the W
    ranks' gradients, then ``AdamS.step``); the parameters after every step."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = make_net(spec.get("seed", 0), dtype)
    lr = spec.get("lr", 1e-2)
    opt = AdamS(param_groups(model, lr), lr=lr)
    params = []
    for step in range(spec["steps"]):
        grads = []
        for r in range(world_size):
            model.zero_grad(set_to_none=True)
            x, y = make_batch(r, step, dtype)
            (model(x) - y).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        if spec.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
        opt.step()
        params.append(flat(model.parameters()))
    return params


def mass_worker(
    rank: int, comm: Communicator, steps: int, passes: int = 0, sharded: bool = True, staged: bool = False
) -> dict[str, Tensor]:
    """Integer-valued fp64 gradients (so every sum is exact); returns sum g, what was sent, the residual and what
    the steps applied.

    Args:
        rank: This rank.
        comm: The group.
        steps: Optimizer steps.
        passes: Backward passes per step of a loss linear in the parameters (``sum(p * G)``, so each pass adds
            the integer tensor ``G`` to ``param.grad``); 0: set ``param.grad`` directly, no backward.
        sharded: ``ScapeConfig.sharded``.
        staged: ``skip_nonfinite`` (sparse steps stage their values and the residual takes the gradient at the
            step).

    Returns:
        ``grad_sum``: sum of ``param.grad`` at each step; ``sent``: what this rank sent for good (every round's
        values, or the last round's when staged: a staged step sends the whole accumulated gradient again);
        ``residual``; ``applied``: this rank's shard of the averaged values the steps applied.
    """
    from lightning_scape.kernels import mask_positions

    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=0, exploration=0.25, sharded=sharded)
    model = make_net(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm, skip_nonfinite=staged)
    (bs,) = engine.buckets  # one bucket: the whole model fits under bucket_cap_mb
    gen = torch.Generator().manual_seed(rank)
    out = {k: torch.zeros_like(bs.residual) for k in ("grad_sum", "sent", "applied")}
    for _ in range(steps):
        mask = engine.current_masks()[0]
        positions = mask_positions(mask, cfg.chunk_size)
        rounds = []
        if passes == 0:
            for p in model.parameters():
                p.grad = torch.randint(-1000, 1000, p.shape, generator=gen).double()
        for _ in range(passes):
            grads = [torch.randint(-1000, 1000, p.shape, generator=gen).double() for p in model.parameters()]
            sum((p * g).sum() for p, g in zip(model.parameters(), grads, strict=True)).backward()
            rounds.append(bs.values.clone())  # the bucket launched: this round's local values (simulated wait)
        engine.step()  # no backward: the step synchronises the gradients it finds
        out["grad_sum"] += bs.grads
        if passes == 0:
            rounds = [bs.values]  # sharded: the step's own launch, its local values (replicated: the sums)
        for values in rounds[-1:] if staged else rounds:
            out["sent"].index_add_(0, positions, values)
        applied = torch.zeros_like(bs.residual)
        if sharded:
            assert bs.received is not None
            applied.index_add_(0, mask_positions(bs.region_rows(mask), cfg.chunk_size) + bs.region.start, bs.received)
        else:
            applied.index_add_(0, positions, bs.values)
        out["applied"][bs.shard] += applied[bs.shard]
        engine.zero_grad()
    engine.close()
    return {**out, "residual": bs.residual.clone()}


def _process_group_comm() -> Communicator:
    from lightning_scape import ProcessGroupCommunicator

    return ProcessGroupCommunicator(timeout_s=60)


def gloo_run_worker(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_worker` on the default (gloo) process group (for :func:`run_gloo`)."""
    return run_worker(rank, _process_group_comm(), spec)


def gloo_sliced_collectives_worker(rank: int, world_size: int, slice_bytes: int) -> dict[str, bool]:
    """The communicator's gloo reduce-scatter and all-gather sent in slices of ``slice_bytes`` per peer, against
    torch's one-message collectives on the same inputs."""
    import torch.distributed as dist

    from lightning_scape.comm import process_group

    process_group.GLOO_SLICE_BYTES = slice_bytes
    comm = _process_group_comm()
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(world_size * 37, generator=gen)
    shard = torch.empty(37)
    comm.reduce_scatter_sum(shard, values).wait()
    summed = values.clone()
    dist.all_reduce(summed)
    gathered, expected = torch.empty(world_size * 37), torch.empty(world_size * 37)
    comm.all_gather(gathered, shard).wait()
    dist.all_gather_into_tensor(expected, shard)
    indices = torch.randint(-(2**15), 2**15 - 1, (29,), generator=gen, dtype=torch.int16)
    all_indices, expected_indices = torch.empty(world_size * 29, dtype=torch.int16), torch.empty(world_size * 29)
    comm.all_gather(all_indices, indices).wait()
    dist.all_gather_into_tensor(expected_indices, indices.float())
    return {
        # gloo's all-reduce sums in an order of its own: the sums to a tolerance, the moved values exactly.
        "reduce_scatter": torch.allclose(shard, summed.view(world_size, -1)[rank], rtol=1e-6, atol=1e-6),
        "all_gather": torch.equal(gathered, expected),
        "int16": torch.equal(all_indices.float(), expected_indices),
    }


def gloo_mass_worker(rank: int, world_size: int, steps: int) -> dict[str, Tensor]:
    """:func:`mass_worker` on the default (gloo) process group (for :func:`run_gloo`)."""
    return mass_worker(rank, _process_group_comm(), steps)


# ------------------------------------------------------------------- the strategies on the tiny net

N_SAMPLES = 32
BATCH = 4
LR = 0.02
# Small enough for the tiny net: chunks of 64, 6 slots each, 3 buckets, 2 dense steps.
SCAPE = {"density": 0.1, "chunk_size": 64, "dense_warmup_steps": 2, "density_ramp_steps": 0, "bucket_cap_mb": 0.004}


def dataset() -> TensorDataset:
    """The strategy runs' 32 fixed samples."""
    return TensorDataset(*random_batch(123, N_SAMPLES))


def lr_lambda(step: int) -> float:
    """A per-step schedule, so that a wrong step count or a lost LR shows in the parameters."""
    return 1.0 / (1.0 + 0.1 * step)


def rank_batches(rank: int, world_size: int, epochs: int, shuffle: bool = False) -> list[tuple[Tensor, Tensor]]:
    """This rank's batches: indices rank, rank + W, ... or, with ``shuffle``, what the Trainer's
    ``DistributedSampler(shuffle=True, seed=0)`` yields after ``set_epoch(epoch)``."""
    data = dataset()
    x, y = data.tensors
    out = []
    for epoch in range(epochs):
        if shuffle:
            sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            idx = list(sampler)
        else:
            idx = list(range(rank, N_SAMPLES, world_size))
        for i in range(0, len(idx), BATCH):
            sel = torch.tensor(idx[i : i + BATCH])
            out.append((x[sel], y[sel]))
    return out


def reference(
    world_size: int = 2,
    epochs: int = 2,
    accumulate: int = 1,
    max_norm: float | None = None,
    clip_value: float | None = None,
    autocast: torch.dtype | None = None,
    fp16_scale: float | None = None,
    inject_inf_at: int | None = None,
    scape: dict[str, Any] | None = None,
    shuffle: bool = True,
) -> list[dict[str, Any]]:
    """The bare-engine run that a strategy run must reproduce; per rank: final parameters and norms.

    It drives :class:`ScapeEngine` directly in ``world_size`` simulated ranks, so a strategy run is checked
    against code that does not use the adapters. For W = 2 a simulated sum is bitwise what gloo computes.

    Args:
        world_size: Simulated ranks.
        epochs: Passes over the data.
        accumulate: Micro-batches per optimizer step (all but the last under ``no_sync``).
        max_norm: Global-norm clipping.
        clip_value: Value clipping.
        autocast: Run forward under ``torch.autocast("cpu", dtype)``.
        fp16_scale: Initial loss scale of a GradScaler-like procedure (halved on a skipped step).
        inject_inf_at: Optimizer step (0-based) at which rank 1's loss is multiplied by inf.
        scape: SCAPE options (default :data:`SCAPE`).
        shuffle: The Trainer's data order (see :func:`rank_batches`); False for the Fabric loops.
    """
    cfg = ScapeConfig(**(scape or SCAPE))

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        net = make_net()
        opt = AdamS(param_groups(net, LR), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        scale = fp16_scale
        engine = ScapeEngine(
            opt, cfg, comm, param_order=list(net.parameters()),
            loss_scale=None if fp16_scale is None else (lambda: scale), skip_nonfinite=fp16_scale is not None,
        )  # fmt: skip
        norms, skipped, trace = [], [], []
        batches = rank_batches(rank, world_size, epochs, shuffle)
        step = 0
        for i, (x, y) in enumerate(batches):
            last = (i + 1) % accumulate == 0 or i + 1 == len(batches)
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None, cache_enabled=False):
                loss = torch.nn.functional.mse_loss(net(x), y)
            if inject_inf_at == step and rank == 1 and last:
                loss = loss * float("inf")
            loss = loss / accumulate
            if scale is not None:
                loss = loss * scale
            if last:
                loss.backward()
                engine.step(max_grad_norm=max_norm, clip_value=clip_value)
                norms.append(engine.last_grad_norm)
                skipped.append(engine.last_step_skipped)
                if scale is not None and engine.last_step_skipped:
                    scale /= 2
                with warnings.catch_warnings():  # AdamS.step itself never runs: the engine steps
                    warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"))
                    sched.step()
                engine.zero_grad()
                trace.append(flat(net.parameters()))
                step += 1
            else:
                with engine.no_sync():
                    loss.backward()
        state = engine.state_dict()
        engine.close()
        return {"params": flat(net.parameters()), "norms": norms, "skipped": skipped, "engine": state, "trace": trace}

    return simulate(world_size, worker)


def engine_snapshot(engine: ScapeEngine) -> dict[str, Any]:
    """What the strategy tests compare bitwise: momentum, residual, masks, step, counters (totals)."""
    state = engine.state_dict()
    return {
        "momentum": torch.cat([b["momentum"] for b in state["buckets"]]),
        "residual": torch.cat([b["residual"] for b in state["buckets"]]),
        "last_sent": torch.cat([b["last_sent"] for b in state["buckets"]]),
        "masks": [list(b["masks"]) for b in state["buckets"]],
        "step_count": state["step_count"],
        "refresh_count": state["refresh_count"],
        "total_sent": state["counters"]["total_sent"],
    }


def expect_failure(name: str, outdir: str, fn: Callable[[], Any]) -> None:
    """Run ``fn``; save its error message as ``name`` (``{"error": None}`` if it did not raise)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        fn()
        result: dict[str, Any] = {"error": None}
    except Exception as exc:  # the test inspects the message
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    save_output(outdir, name, rank, result)


# ---------------------------------------------------------------------------------------- scenarios

Scenario = TypeVar("Scenario", bound=Callable[..., None])
# Launch name -> the scenarios registered under it, in registration (definition) order.
SCENARIOS: dict[str, list[Callable[..., None]]] = {}
LAUNCHER = os.path.join(HERE, "_launch_scenarios.py")


def scenario(launch: str) -> Callable[[Scenario], Scenario]:
    """Register ``fn(outdir, *args)`` as one scenario of the multi-process launch named ``launch``.

    ``python _launch_scenarios.py <module> <launch> <outdir> [args]`` imports the test module and runs its
    scenarios of that launch in every process, in the order they are defined; they save their results with
    :func:`save_output` for the tests beside them to assert on. One launch runs many scenarios because
    starting Lightning processes costs seconds.
    """

    def register(fn: Scenario) -> Scenario:
        SCENARIOS.setdefault(launch, []).append(fn)
        return fn

    return register


def launcher_args(module: str, launch: str, outdir: str, *args: str) -> list[str]:
    """The command-line arguments (after ``python``) that run ``module``'s scenarios of ``launch``."""
    return [LAUNCHER, module, launch, outdir, *args]
