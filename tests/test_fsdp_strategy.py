"""ScapeFSDPStrategy (Fabric and Trainer) on four gloo processes (2 groups x shard_size 2) started by torchrun.

Each ``@scenario("fsdp_fabric")`` function is one Fabric run, each ``@scenario("fsdp_trainer")`` one or two
Trainer fits; the ``fsdp_runs`` and ``fsdp_trainer_runs`` fixtures run each launch's scenarios, in order, in one
``torchrun --nproc_per_node=4`` launch, and the tests read what they saved. References are
computed here, in one process: data-parallel AdamS over the four ranks' batches (density 1), and
``simulate(R)`` of the flat engine fed each group's averaged gradient (density < 1).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    PYTHON,
    child_env,
    expect_failure,
    launcher_args,
    load_outputs,
    rank_zero_messages,
    rel_err,
    save_output,
    scenario,
)
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tiny_gpt import GPT_CONFIG, LR, LitGPT, RankBatches, full_params, lm_loss, reference_adams, tiny_gpt, tokens
from torch import Tensor, nn

from lightning_scape import (
    AdamS,
    CommunicationMonitor,
    DenseWarmupWarning,
    MaskMonitor,
    ScapeConfig,
    ScapeEngine,
    ScapeFSDPStrategy,
    simulate,
)
from lightning_scape.comm import Communicator
from lightning_scape.examples.workloads import free_port
from lightning_scape.kernels import mask_positions
from lightning_scape.planning import pilot, run_summary
from lightning_scape.pytorch import ScapeFSDPStrategy as TrainerFSDPStrategy
from lightning_scape.runtime.fsdp import DTENSOR_CPU_INIT_WARNING

pytestmark = pytest.mark.dist

W, S = 4, 2  # four processes, shard_size 2: R = 2 groups
R = W // S
SPARSE = {"density": 0.05, "dense_warmup_steps": 0, "chunk_size": 64}
# The int8 wire across the groups: two dense steps (int8 packets of the shard's gradient and parameter changes),
# then sparse ones.
SPARSE_INT8 = {**SPARSE, "wire_format": "int8", "dense_warmup_steps": 2, "density_ramp_steps": 0}
RUNS = {"sparse": SPARSE, "sparse_int8": SPARSE_INT8}


def launch(strategy: ScapeFSDPStrategy, **kwargs: Any) -> Fabric:
    """A launched four-process CPU Fabric (the torchrun processes)."""
    fabric = Fabric(accelerator="cpu", devices=W, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def train(
    fabric: Fabric, model: Any, opt: Any, steps: range, accumulate: int = 1, max_norm: float | None = None
) -> list[Tensor]:
    """Optimizer steps over this rank's batches; the full parameters after each."""
    out = []
    for step in steps:
        for micro in range(accumulate):
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(lm_loss(model, tokens(fabric.global_rank, step, micro)) / accumulate)
        if max_norm is not None:
            fabric.clip_gradients(model, opt, max_norm=max_norm)
        opt.step()
        opt.zero_grad()
        out.append(full_params(model))
    return out


def rank() -> int:
    return int(os.environ["RANK"])


# ------------------------------------------------------------------------------ scenarios and their tests


@scenario("fsdp_fabric")
def density_one(outdir: str) -> None:
    """The held-out usage: setup_module, then setup_optimizers(AdamS(model.parameters())); density 1."""
    fabric = launch(ScapeFSDPStrategy(density=1.0, dense_warmup_steps=0, shard_size=S))
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    params = train(fabric, model, opt, range(3))
    save_output(outdir, "density_one", rank(), {"params": params, "grid": fabric.strategy.grid})


def test_density_one_reproduces_data_parallel_adams(fsdp_runs: str) -> None:
    ref = reference_adams(W, 3)
    for r, out in enumerate(load_outputs(fsdp_runs, "density_one", W)):
        assert (out["grid"].replica_index, out["grid"].shard_index) == divmod(r, S)
        for step, got in enumerate(out["params"]):
            assert rel_err(got, ref[step]) < 1e-5, (r, step, rel_err(got, ref[step]))
    assert rel_err(ref[-1], ref[0]) > 1e-3  # the runs moved the model


@scenario("fsdp_fabric")
def accumulation_and_clipping(outdir: str) -> None:
    """Two micro-batches per step (the first under no_backward_sync), global-norm clipping, fabric.setup jointly."""
    fabric = launch(ScapeFSDPStrategy(density=1.0, dense_warmup_steps=0, shard_size=S))
    net = tiny_gpt()
    model, opt = fabric.setup(net, AdamS(net.parameters(), lr=LR))
    engine = fabric.strategy.engine
    sent_before = dict(engine.counters.total_sent)
    with fabric.no_backward_sync(model, enabled=True):
        fabric.backward(lm_loss(model, tokens(rank(), 0, 0)) / 2)
    sent_while_accumulating = dict(engine.counters.total_sent)
    fabric.backward(lm_loss(model, tokens(rank(), 0, 1)) / 2)
    asked = float(fabric.strategy.global_grad_norm())
    norm = float(fabric.clip_gradients(model, opt, max_norm=0.2))
    opt.step()
    opt.zero_grad()
    params = [full_params(model), *train(fabric, model, opt, range(1, 3), accumulate=2, max_norm=0.2)]
    out = {"params": params, "norm": norm, "asked": asked}
    out |= {"before": sent_before, "accumulating": sent_while_accumulating}
    save_output(outdir, "accumulation", rank(), out)


def test_accumulation_sends_nothing_and_clipping_uses_the_global_norm(fsdp_runs: str) -> None:
    ref = reference_adams(W, 3, accumulate=2, max_norm=0.2)
    model = tiny_gpt()
    for micro in range(2):
        for r in range(W):
            lm_loss(model, tokens(r, 0, micro)).backward()
    global_norm = torch.sqrt(sum((p.grad / (2 * W)).pow(2).sum() for p in model.parameters()))
    for out in load_outputs(fsdp_runs, "accumulation", W):
        assert out["accumulating"] == out["before"]
        assert abs(out["norm"] - float(global_norm)) < 1e-5 * float(global_norm)
        assert abs(out["asked"] - float(global_norm)) < 1e-5 * float(global_norm)  # strategy.global_grad_norm()
        assert float(global_norm) > 0.2  # clipping was active
        for step, got in enumerate(out["params"]):
            assert rel_err(got, ref[step]) < 1e-5, (step, rel_err(got, ref[step]))


@scenario("fsdp_fabric")
def sparse_run(outdir: str) -> None:
    """Density 0.05 from the first step: what the tests compare with simulate(R), and the shard sizes."""
    _sparse_run(outdir, "sparse")


@scenario("fsdp_fabric")
def sparse_int8_run(outdir: str) -> None:
    """The int8 wire: two dense steps, then density 0.05."""
    _sparse_run(outdir, "sparse_int8")


def _sparse_run(outdir: str, name: str) -> None:
    strategy = ScapeFSDPStrategy(shard_size=S, **RUNS[name])
    fabric = launch(strategy)
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    engine = strategy.engine
    layout = [
        {"shape": tuple(p.shape), "group": g}
        for g, grp in enumerate(engine.optimizer.param_groups)
        for p in grp["params"]
    ]
    start = [bs.params.clone() for bs in engine.buckets]
    grads, params, sent = [], [], []
    for step in range(4):
        fabric.backward(lm_loss(model, tokens(rank(), step)))
        grads.append([bs.grads.clone() for bs in engine.buckets])
        opt.step()
        opt.zero_grad()
        params.append(full_params(model))
        sent.append(dict(engine.counters.step_sent))
    total = sum(p.numel() for p in model.parameters())
    out = {
        "layout": layout,
        "start": start,
        "grads": grads,
        "end": [bs.params.clone() for bs in engine.buckets],
        "params": params,
        "sent": sent,
        "slots": engine.slots,
        "local_fraction": strategy.binding.local_numel() / total,
        "comm": (type(engine.comm).__name__, engine.comm.rank, engine.comm.world_size),
    }
    save_output(outdir, name, rank(), out)


@scenario("fsdp_fabric")
def defaults_on_shards_that_read_different_links(outdir: str) -> None:
    """SCAPE chooses the form, each shard's probes reading its own link: 100 kbit/s on shard 0, 1 Tbit/s on shard 1
    (the step in use predicted from it too, not taken from the loopback's wall-clock)."""
    bps = 1e5 if rank() % S == 0 else 1e12

    def timed(engine: ScapeEngine, numel: int) -> float:
        return 32 * numel / bps

    timed_gather, pilot.timed_gather = pilot.timed_gather, timed
    step_time, pilot.FormPilot._step_time = pilot.FormPilot._step_time, lambda self, samples: None  # type: ignore[method-assign]
    try:
        strategy = ScapeFSDPStrategy(shard_size=S, dense_warmup_steps=5, density_ramp_steps=2, chunk_size=64)
        fabric = launch(strategy)
        model = fabric.setup_module(tiny_gpt())
        opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
        params = train(fabric, model, opt, range(8))
    finally:
        pilot.timed_gather, pilot.FormPilot._step_time = timed_gather, step_time  # type: ignore[method-assign]
    decisions = [(d.step, d.chosen.name, d.link.bandwidth_bps) for d in strategy.engine.pilot.decisions]
    save_output(outdir, "shard_links", rank(), {"decisions": decisions, "params": params[-1]})


def test_the_shards_take_one_form_from_their_mean_link(fsdp_runs: str) -> None:
    # Each shard's engine decides over its own ranks; left to themselves, shard 0 would go sparse and shard 1 stay
    # dense, and every step would wait for the dense one. Their measurements are averaged over the shard group.
    outs = load_outputs(fsdp_runs, "shard_links", W)
    (decision,) = outs[0]["decisions"]
    assert all(out["decisions"] == [decision] for out in outs)
    assert decision[0] == 5 and " d=" in decision[1]  # sparse, as shard 0 alone would choose; shard 1: fp32 dense
    assert decision[2] == pytest.approx(2 / (1 / 1e5 + 1 / 1e12), rel=1e-6)  # the shards' mean time: 200 kbit/s
    assert all(torch.equal(out["params"], outs[0]["params"]) for out in outs)


@pytest.mark.parametrize("name", RUNS)
def test_sparse_replicas_identical_and_each_rank_holds_its_shard(fsdp_runs: str, name: str) -> None:
    outs = load_outputs(fsdp_runs, name, W)
    # The engine runs on the replicate group (rank r // S of R), through the communicator whose failures name the
    # global rank that stopped answering (the heartbeats are global).
    assert [out["comm"] for out in outs] == [("FaultNamingCommunicator", r // S, W // S) for r in range(W)]
    for step in range(4):
        for r in range(1, W):
            assert torch.equal(outs[r]["params"][step], outs[0]["params"][step]), (step, r)
    assert not torch.equal(outs[0]["params"][-1], outs[0]["params"][0])
    for out in outs:
        assert out["local_fraction"] <= 0.6, out["local_fraction"]


def test_sparse_bytes_equal_the_formula(fsdp_runs: str) -> None:
    for out in load_outputs(fsdp_runs, "sparse", W):
        dN = out["slots"]  # the slots of this shard over the R groups
        for sent in out["sent"]:
            # docs/algorithm.md section 5, sharded, R groups, fp32 values and parameters, int16 indices.
            assert sent["values"] + sent["params"] + sent["indices"] == (R - 1) * dN * (4 + 4 + 2) // R, sent
            assert sent["dense"] == 0


def _simulated_shard(out: dict[str, Any], config: ScapeConfig) -> list[list[Tensor]]:
    """simulate(R) of the flat engine on one shard: each group fed its averaged gradient, from the same start."""

    def worker(group: int, comm: Communicator) -> list[Tensor]:
        shard = out[group]
        proxies = [nn.Parameter(torch.zeros(e["shape"])) for e in shard["layout"]]
        groups = sorted({e["group"] for e in shard["layout"]})
        opt = AdamS(
            [{"params": [p for p, e in zip(proxies, shard["layout"], strict=True) if e["group"] == g]} for g in groups],
            lr=LR,
        )
        engine = ScapeEngine(opt, config, comm, param_order=proxies, sync_params=False)
        for bs, start in zip(engine.buckets, shard["start"], strict=True):
            bs.params.copy_(start)
        for step_grads in shard["grads"]:
            for bs, g in zip(engine.buckets, step_grads, strict=True):
                bs.grads.copy_(g)
            engine.step()
            engine.zero_grad()
        return [bs.params.clone() for bs in engine.buckets]

    return simulate(R, worker)


@pytest.mark.parametrize("name", RUNS)
def test_sparse_run_equals_simulate_of_the_groups_averaged_gradients(fsdp_runs: str, name: str) -> None:
    outs = load_outputs(fsdp_runs, name, W)
    for s in range(S):
        shard = [outs[g * S + s] for g in range(R)]  # the ranks that hold shard s
        simulated = _simulated_shard(shard, ScapeConfig(**RUNS[name]))
        for g in range(R):
            for sim, real in zip(simulated[g], shard[g]["end"], strict=True):
                assert rel_err(sim.double(), real.double()) < 1e-6, (s, g)


class TwoHeads(nn.Module):
    """Two linear maps of the same input, summed: each weight's gradient is ``c^T x``, an integer for integer data."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 16, bias=False)
        self.b = nn.Linear(24, 16, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.b(x)


@scenario("fsdp_fabric")
def mass_fp64(outdir: str) -> None:
    """fp64, integer inputs: every gradient FSDP averages over a group is exact, so the mass balance is exact."""
    fabric = launch(ScapeFSDPStrategy(shard_size=S, auto_wrap_policy={nn.Linear}, **SPARSE))
    torch.manual_seed(0)
    net = TwoHeads().double()
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=1e-3))
    engine = fabric.strategy.engine
    gen = torch.Generator().manual_seed(rank())
    grad_sum = [torch.zeros_like(bs.residual) for bs in engine.buckets]
    sent = [torch.zeros_like(bs.residual) for bs in engine.buckets]
    for _ in range(6):
        masks = engine.current_masks()
        x = torch.randint(-8, 8, (4, 24), generator=gen).double()
        c = torch.randint(-8, 8, (4, 16), generator=gen).double()
        fabric.backward((model(x) * c).sum())
        for i, bs in enumerate(engine.buckets):
            grad_sum[i] += bs.grads
        opt.step()
        for i, bs in enumerate(engine.buckets):
            sent[i].index_add_(0, mask_positions(masks[i], bs.layout.chunk_size), bs.values)
        opt.zero_grad()
    out = {"grad_sum": grad_sum, "sent": sent, "residual": [bs.residual.clone() for bs in engine.buckets]}
    save_output(outdir, "mass", rank(), out)


def test_no_gradient_mass_is_lost(fsdp_runs: str) -> None:
    for out in load_outputs(fsdp_runs, "mass", W):
        for g, s, e in zip(out["grad_sum"], out["sent"], out["residual"], strict=True):
            assert torch.equal(g, s + e)
            assert s.abs().sum() > 0 and e.abs().sum() > 0


@scenario("fsdp_fabric")
def checkpoint_round_trip(outdir: str) -> None:
    """Save after 2 sparse steps and go on 2 steps; a fresh run that loads the checkpoint takes the same 2 steps;
    a run with another shard_size is refused before anything loads."""
    path = os.path.join(outdir, "ckpt")
    fabric = launch(ScapeFSDPStrategy(shard_size=S, **SPARSE))
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    train(fabric, model, opt, range(2))
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    first = train(fabric, model, opt, range(2, 4))

    fabric = launch(ScapeFSDPStrategy(shard_size=S, **SPARSE))
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    rest = fabric.load(path, state)
    second = train(fabric, model, opt, range(state["step"], 4))

    fabric = launch(ScapeFSDPStrategy(shard_size=W, **SPARSE))
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    before = full_params(model)
    expect_failure("refused", outdir, lambda: fabric.load(path, {"model": model, "optimizer": opt}))
    unchanged = torch.equal(before, full_params(model)) and fabric.strategy.engine.step_count == 0
    save_output(outdir, "checkpoint", rank(), {"first": first, "second": second, "rest": rest, "unchanged": unchanged})


def test_checkpoint_round_trip_is_bitwise(fsdp_runs: str) -> None:
    for out in load_outputs(fsdp_runs, "checkpoint", W):
        assert out["rest"] == {}
        assert all(torch.equal(a, b) for a, b in zip(out["first"], out["second"], strict=True))
        assert out["unchanged"]


def test_another_shard_size_is_refused_with_the_fix(fsdp_runs: str) -> None:
    for out in load_outputs(fsdp_runs, "refused", W):
        assert out["error"] is not None
        assert "shard_size=2" in out["error"] and "Nothing was loaded" in out["error"], out["error"]


@scenario("fsdp_fabric")
def load_raw(outdir: str) -> None:
    """``fabric.load_raw`` of a plain, whole-model state dict (another initialisation of the model, and a key the
    model does not have) into the set-up model, against a model set up from those weights: both then take the
    same two steps. A file without ``lm_head.weight`` is refused under ``strict`` (nothing loaded), and without
    ``strict`` loads the rest, as Lightning's ``ModelParallelStrategy`` does."""
    from litgpt.model import GPT, Config

    fabric = launch(ScapeFSDPStrategy(shard_size=S, **SPARSE))
    torch.manual_seed(1)
    other = GPT(Config(**GPT_CONFIG))
    weights = {name: t.detach().clone() for name, t in other.state_dict().items()}
    path, partial = os.path.join(outdir, "raw.pt"), os.path.join(outdir, "raw_partial.pt")
    if rank() == 0:
        torch.save({**weights, "extra.weight": torch.ones(3)}, path)
        torch.save({k: v for k, v in weights.items() if k != "lm_head.weight"}, partial)
    fabric.barrier()
    model = fabric.setup_module(other)
    expected = train(fabric, model, fabric.setup_optimizers(AdamS(model.parameters(), lr=LR)), range(2))

    fabric = launch(ScapeFSDPStrategy(shard_size=S, **SPARSE))
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    fabric.load_raw(path, model)
    loaded = {name: p.full_tensor() for name, p in model.module.named_parameters()}
    trace = train(fabric, model, opt, range(2))
    before = full_params(model)
    expect_failure("load_raw_strict", outdir, lambda: fabric.load_raw(partial, model))
    unchanged = torch.equal(before, full_params(model))
    fabric.load_raw(partial, model, strict=False)
    lenient = {name: p.full_tensor() for name, p in model.module.named_parameters()}
    out = {"weights": weights, "loaded": loaded, "trace": trace, "expected": expected, "unchanged": unchanged}
    save_output(outdir, "load_raw", rank(), {**out, "lenient": lenient, "before": before})


def test_load_raw_loads_a_whole_state_dict_into_the_shards_as_model_parallel_strategy(fsdp_runs: str) -> None:
    for out in load_outputs(fsdp_runs, "load_raw", W):
        assert out["loaded"].keys() == out["weights"].keys()  # the file's extra key left alone
        assert all(torch.equal(out["loaded"][k], v) for k, v in out["weights"].items())
        # The engine steps from the loaded weights: the same steps as a model set up from them.
        assert all(torch.equal(a, b) for a, b in zip(out["trace"], out["expected"], strict=True))
        assert out["unchanged"]  # strict: refused on every rank before anything loaded
        lenient = out["lenient"]
        assert all(torch.equal(lenient[k], v) for k, v in out["weights"].items() if k != "lm_head.weight")
        assert not torch.equal(lenient["lm_head.weight"], out["weights"]["lm_head.weight"])  # kept its value
    for out in load_outputs(fsdp_runs, "load_raw_strict", W):
        assert out["error"] is not None and "The model contains a key 'lm_head.weight'" in out["error"], out["error"]


@scenario("fsdp_fabric")
def bf16_mixed(outdir: str) -> None:
    """precision="bf16-mixed" (autocast; fp32 parameters, gradients and SCAPE state) at density 1."""
    fabric = launch(ScapeFSDPStrategy(density=1.0, dense_warmup_steps=0, shard_size=S), precision="bf16-mixed")
    model = fabric.setup_module(tiny_gpt())
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    save_output(outdir, "bf16", rank(), {"params": train(fabric, model, opt, range(3))})


def test_bf16_mixed_stays_close_to_fp32_data_parallel_adams(fsdp_runs: str) -> None:
    ref = reference_adams(W, 3)
    outs = load_outputs(fsdp_runs, "bf16", W)
    for out in outs:
        assert all(torch.equal(a, b) for a, b in zip(out["params"], outs[0]["params"], strict=True))
        err = rel_err(out["params"][-1], ref[-1])
        assert 0 < err < 2e-2, err  # bf16 matmuls: close to the fp32 reference, and not equal to it


@scenario("fsdp_fabric")
def meta_init(outdir: str) -> None:
    """``fabric.init_module(empty_init=True)``: built on the meta device, materialised shard by shard."""
    fabric = launch(ScapeFSDPStrategy(shard_size=S, **SPARSE))
    with fabric.init_module(empty_init=True):
        net = tiny_gpt()
    meta = all(p.is_meta for p in net.parameters())
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(AdamS(model.parameters(), lr=LR))
    start = full_params(model)
    params = train(fabric, model, opt, range(2))
    save_output(outdir, "meta", rank(), {"meta": meta, "start": start, "params": params})


def test_meta_device_initialisation_gives_every_group_the_same_model(fsdp_runs: str) -> None:
    outs = load_outputs(fsdp_runs, "meta", W)
    for out in outs:
        assert out["meta"] and torch.isfinite(out["start"]).all() and out["start"].abs().sum() > 0
        assert torch.equal(out["start"], outs[0]["start"])
        assert all(torch.equal(a, b) for a, b in zip(out["params"], outs[0]["params"], strict=True))


DOC = Path(__file__).resolve().parent.parent / "docs" / "fsdp.md"
DOC_EXAMPLE = re.compile(r"```python\n(# train_fsdp\.py[^\n]*\n.*?)```.*?```text\n(.*?)```", re.S)


@scenario("fsdp_fabric")
def the_docs_fabric_example(outdir: str) -> None:
    """docs/fsdp.md's ``train_fsdp.py`` as it stands there (its ``devices=4, shard_size=2`` are these torchrun
    processes): what it logged, printed and warned, and its summary at the end."""
    code = DOC_EXAMPLE.search(DOC.read_text()).group(1)  # type: ignore[union-attr]
    here = os.getcwd()
    os.chdir(outdir)  # its checkpoint folder, "ckpt", goes there
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, rank_zero_messages() as logged:
            warnings.simplefilter("default")  # as a plain `python train_fsdp.py` shows them: once per place
            with contextlib.redirect_stdout(printed):
                namespace: dict[str, Any] = {"__name__": "__main__"}
                exec(compile(code, "train_fsdp.py", "exec"), namespace)
            namespace["fabric"].strategy.scape_runtime.end_of_run()  # what its exit hook does
    finally:
        os.chdir(here)
    out = {
        "logged": logged,
        "printed": printed.getvalue(),
        "dtensor_warnings": sum(DTENSOR_CPU_INIT_WARNING in str(w.message) for w in caught),
        "checkpoint": sorted(os.listdir(os.path.join(outdir, "ckpt"))),
    }
    save_output(outdir, "docs_example", rank(), out)


def test_the_docs_fabric_example_runs_says_what_scape_does_and_warns_once(fsdp_runs: str) -> None:
    outs = load_outputs(fsdp_runs, "docs_example", W)
    shown = DOC_EXAMPLE.search(DOC.read_text()).group(2).splitlines()  # type: ignore[union-attr]
    startup = [m for m in outs[0]["logged"] if m.startswith("lightning_scape: SCAPE on")]
    # The start-up line the page shows is the one rank 0 logged: what SCAPE will do, across the groups.
    assert startup == [shown[0]] and "across 2 groups of shard_size=2 processes" in shown[0]
    (summary,) = [m for m in outs[0]["logged"] if m.startswith(run_summary.HEADING)]
    assert "HSDP would have sent" in summary and "21 sparse at density 0.01" in summary
    assert all(not out["logged"] for out in outs[1:])  # rank 0 speaks for all
    losses = [float(line.rsplit(" ", 1)[1]) for line in outs[0]["printed"].splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the pattern is being learnt
    # torch's warning about initialising DTensors on a CPU mesh: once (rank 0), not once per process.
    assert [out["dtensor_warnings"] for out in outs] == [1, 0, 0, 0]
    assert outs[0]["checkpoint"] == ["meta.pt"] + [f"shard-{r:05d}.pt" for r in range(W)]


# ------------------------------------------------------------------------------------- the Trainer form


class FullParams(L.Callback):
    """The full parameters at the end of the fit (every rank takes part in the all-gather)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = full_params(pl_module)


def fit(strategy: TrainerFSDPStrategy, data: RankBatches, ckpt_path: str | None = None, **kwargs: Any) -> Tensor:
    """A Trainer fit on the four torchrun processes; the full parameters at its end."""
    params = FullParams()
    kwargs = {"logger": False, "enable_checkpointing": False, **kwargs}
    kwargs["callbacks"] = [params, *kwargs.get("callbacks", [])]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=W,
        strategy=strategy,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(LitGPT(), torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt_path)
    return params.params


@scenario("fsdp_trainer")
def trainer_density_one(outdir: str) -> None:
    """Accumulation over 2 micro-batches, gradient_clip_val by norm (density 1: every step is sent dense)."""
    monitors = [CommunicationMonitor(log_every_n_steps=1)]
    logger = CSVLogger(outdir, name="dense_logs", version=0)
    strategy = TrainerFSDPStrategy(density=1.0, dense_warmup_steps=0, shard_size=S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the children run with PYTHONWARNINGS=ignore
        params = fit(
            strategy,
            RankBatches(3, rank(), accumulate=2),
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.2,
            callbacks=monitors,
            logger=logger,
            log_every_n_steps=1,
        )
    notices = [str(w.message) for w in caught if issubclass(w.category, DenseWarmupWarning)]
    save_output(outdir, "trainer", rank(), {"params": params, "notices": notices})


def test_trainer_accumulation_and_clipping_reproduce_data_parallel_adams(fsdp_trainer_runs: str) -> None:
    ref = reference_adams(W, 3, accumulate=2, max_norm=0.2)
    outs = load_outputs(fsdp_trainer_runs, "trainer", W)
    for out in outs:
        assert rel_err(out["params"], ref[-1]) < 1e-5, rel_err(out["params"], ref[-1])
    # Every step sent dense (density 1): told once, by rank 0, before the first batch, as ScapeStrategy tells it.
    (notice,) = outs[0]["notices"]
    assert notice.startswith("lightning_scape: this run has 3 optimizer steps") and "density" in notice, notice
    assert all(not out["notices"] for out in outs[1:])
    metrics = (Path(fsdp_trainer_runs) / "dense_logs" / "version_0" / "metrics.csv").read_text()
    assert "comm/sent_bytes/dense" in metrics


@scenario("fsdp_trainer")
def trainer_checkpoint(outdir: str) -> None:
    """Four sparse steps saving a checkpoint folder after each epoch; a fit resumed from the one after step 2 goes
    on bitwise as the uninterrupted one. An epoch is one batch: Lightning may not resume the data order of an
    epoch it saved at its end, and one batch per epoch leaves it nothing to get wrong."""
    folder = os.path.join(outdir, "ckpts")
    save = ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    monitors = [CommunicationMonitor(log_every_n_steps=1), MaskMonitor(log_every_n_steps=1)]
    whole = fit(
        TrainerFSDPStrategy(shard_size=S, **SPARSE),
        RankBatches(1, rank()),
        max_steps=4,
        callbacks=[save, *monitors],
        enable_checkpointing=True,
        logger=CSVLogger(outdir, name="sparse_logs", version=0),
        log_every_n_steps=1,
    )
    first = os.path.join(folder, "epoch=1-step=2.ckpt")
    resumed = fit(TrainerFSDPStrategy(shard_size=S, **SPARSE), RankBatches(1, rank()), ckpt_path=first, max_steps=4)
    files = sorted(os.listdir(first))
    save_output(outdir, "trainer_ckpt", rank(), {"whole": whole, "resumed": resumed, "files": files})


def test_trainer_resumes_a_sharded_checkpoint_bitwise(fsdp_trainer_runs: str) -> None:
    metrics = (Path(fsdp_trainer_runs) / "sparse_logs" / "version_0" / "metrics.csv").read_text()
    assert "comm/sent_bytes/values" in metrics and "mask/residual_norm" in metrics
    outs = load_outputs(fsdp_trainer_runs, "trainer_ckpt", W)
    for out in outs:
        assert torch.equal(out["whole"], out["resumed"])
        assert torch.equal(out["whole"], outs[0]["whole"])
        assert out["files"] == ["meta.pt"] + [f"shard-{r:05d}.pt" for r in range(W)]


# ------------------------------------------------------------------------------------------ the launches


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what the scenarios above saved: one ``torchrun --nproc_per_node=4`` launch."""
    return _torchrun(str(tmp_path_factory.mktemp("fsdp")), "fsdp_fabric")


@pytest.fixture(scope="module")
def fsdp_trainer_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of what the Trainer scenarios saved: one ``torchrun --nproc_per_node=4`` launch."""
    return _torchrun(str(tmp_path_factory.mktemp("fsdp_trainer")), "fsdp_trainer")


def _torchrun(out: str, launch_name: str) -> str:
    torchrun = [
        os.path.join(os.path.dirname(PYTHON), "torchrun"),
        f"--nproc_per_node={W}",
        f"--master_port={free_port()}",
        *launcher_args("test_fsdp_strategy", launch_name, out),
    ]
    proc = subprocess.run(torchrun, env=child_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return out
