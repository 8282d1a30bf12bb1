"""The SCAPE engine in one process: world size 1 and the W-rank thread simulation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers import (
    flat,
    make_batch,
    make_net,
    mass_worker,
    param_groups,
    reference_dense_adams,
    rel_err,
    run_worker,
)
from torch import nn

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator, Pending, SoloCommunicator
from lightning_scape.engine import feedback
from lightning_scape.kernels import chunk_topk_ref, mask_positions, mask_scores_ref


def sim(world_size: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`helpers.run_worker` on ``world_size`` simulated ranks."""
    return simulate(world_size, lambda rank, comm: run_worker(rank, comm, spec))


# ---------------------------------------------------------------- density 1 is data-parallel AdamS


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_density_one_reproduces_data_parallel_adams(world_size: int, sharded: bool) -> None:
    spec = {
        "steps": 20,
        "config": {
            "density": 1.0,
            "chunk_size": 32,
            "dense_warmup_steps": 0,
            "sharded": sharded,
            "exploration": 0.0,
        },
    }
    ref = reference_dense_adams(spec, world_size)
    for rank_out in sim(world_size, spec):
        for step in range(20):
            assert rel_err(rank_out["params"][step], ref[step]) < 1e-6, step


def test_dense_warmup_steps_are_data_parallel_adams() -> None:
    spec = {"steps": 6, "config": {"density": 0.01, "chunk_size": 64, "dense_warmup_steps": 6, "density_ramp_steps": 0}}
    ref = reference_dense_adams(spec, 2)
    out = sim(2, spec)
    for step in range(6):
        assert rel_err(out[0]["params"][step], ref[step]) < 1e-6


# ---------------------------------------------------------------- replicas, mass, masks


@pytest.mark.parametrize(
    ("cfg", "statistic"),
    [
        ({"sharded": True}, "momentum"),
        ({"sharded": False}, "momentum"),
        ({"sharded": True}, "gradient"),  # the benchmarks' baseline
        ({"mask_delay": 0}, "momentum"),
        ({"catch_up_cap": 1.0}, "momentum"),
        ({"dense_warmup_steps": 2, "density_ramp_steps": 4}, "momentum"),
    ],
)
def test_replicas_stay_bitwise_identical_at_low_density(cfg: dict[str, Any], statistic: str) -> None:
    config = {"density": 0.02, "chunk_size": 256, "dense_warmup_steps": 2, "density_ramp_steps": 0, **cfg}
    spec = {"steps": 8, "config": config, "statistic": statistic}
    out = sim(4, spec)
    for step in range(8):
        for r in range(1, 4):
            assert torch.equal(out[0]["params"][step], out[r]["params"][step]), (step, r)
    # ... and sparse steps really moved the parameters.
    assert not torch.equal(out[0]["params"][3], out[0]["params"][7])


def test_bf16_parameters_replicas_identical_and_two_byte_values() -> None:
    spec = {
        "steps": 5,
        "dtype": "bfloat16",
        "config": {"density": 0.05, "chunk_size": 128, "dense_warmup_steps": 1, "density_ramp_steps": 0},
    }
    out = sim(2, spec)
    for step in range(5):
        assert torch.equal(out[0]["params"][step], out[1]["params"][step])
    slots = out[0]["slots"]
    assert out[0]["sent"][-1]["values"] == (2 - 1) * slots * 2 // 2  # (W-1)/W * dN * 2 bytes


def test_bf16_parameters_on_the_int8_wire_keep_replicas_identical() -> None:
    """The int8 wire's rounding error, left in the bf16 values, goes back into the fp32 residual (it raised a dtype
    error at the first sparse step)."""
    config = {"density": 0.05, "chunk_size": 128, "dense_warmup_steps": 1, "density_ramp_steps": 0}
    out = sim(2, {"steps": 5, "dtype": "bfloat16", "config": {**config, "wire_format": "int8"}})
    for step in range(5):
        assert torch.equal(out[0]["params"][step], out[1]["params"][step])
    assert not torch.equal(out[0]["params"][1], out[0]["params"][4])  # the sparse steps moved the parameters


def test_no_gradient_mass_is_lost_exactly() -> None:
    """Integer-valued fp64 gradients make every sum exact: sum_t g = sent + residual, per rank and coordinate."""
    results = simulate(2, lambda rank, comm: mass_worker(rank, comm, steps=12))
    for r in results:
        assert torch.equal(r["grad_sum"], r["sent"] + r["residual"])
        assert r["sent"].abs().sum() > 0 and r["residual"].abs().sum() > 0
    total_g = sum(r["grad_sum"] for r in results)
    assert torch.equal(total_g, sum(r["sent"] + r["residual"] for r in results))


@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_no_gradient_mass_is_lost_over_several_backward_passes_per_step(
    passes: int, staged: bool, sharded: bool
) -> None:
    """Backward passes after the first reach buckets already sent this step: sum_t g = W * applied + residuals
    over the ranks, exactly, and per rank sum_t g = sent + residual."""
    W = 2
    results = simulate(W, lambda rank, comm: mass_worker(rank, comm, 8, passes, sharded, staged))
    total_g = sum(r["grad_sum"] for r in results)
    applied = sum(r["applied"] for r in results)
    assert torch.equal(total_g, W * applied + sum(r["residual"] for r in results))
    for r in results:
        assert torch.equal(r["grad_sum"], r["sent"] + r["residual"])
        assert r["applied"].abs().sum() > 0 and r["residual"].abs().sum() > 0


def test_masks_lie_in_their_owners_shards_with_distinct_slots() -> None:
    W = 2
    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=2, density_ramp_steps=0, bucket_cap_mb=1.0)

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        model = make_net(0)
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm)
        for step in range(4):
            x, y = make_batch(rank, step)
            (model(x) - y).pow(2).mean().backward()
            engine.step()
            engine.zero_grad()
        bs = engine.buckets[0]
        own_scores = mask_scores_ref(bs.momentum, bs.region_residual, 0.9, "momentum")
        own = chunk_topk_ref(
            own_scores,
            cfg.chunk_size,
            cfg.slots_per_chunk,
            cfg.explore_slots_per_chunk,
            ((engine.refresh_count - 1) * cfg.explore_slots_per_chunk) % cfg.chunk_size,
        )
        return {
            "mask": engine.last_built_masks()[0].clone(),
            "own": own,
            "S": bs.layout.shard_numel,
            "n_c": bs.layout.chunks_per_shard,
        }

    out = simulate(W, worker)
    assert torch.equal(out[0]["mask"], out[1]["mask"])  # every rank knows the whole mask
    mask, S, n_c, k = out[0]["mask"], out[0]["S"], out[0]["n_c"], cfg.slots_per_chunk
    assert mask.shape == (W * n_c, k)
    for row in mask.long():
        assert len(set(row.tolist())) == k and row.min() >= 0 and row.max() < cfg.chunk_size
        assert torch.equal(row, row.sort().values)
    pos = mask_positions(mask, cfg.chunk_size).view(W, -1)
    for r in range(W):
        assert pos[r].min() >= r * S and pos[r].max() < (r + 1) * S
        # Rank r's rows are exactly what rank r computed from its own momentum and residual.
        assert torch.equal(mask[r * n_c : (r + 1) * n_c], out[r]["own"])


def test_exploration_flushes_every_coordinate_within_c_over_k_explore_steps() -> None:
    cfg = ScapeConfig(
        density=0.125, chunk_size=64, dense_warmup_steps=1, density_ramp_steps=0, exploration=0.5, bucket_cap_mb=1.0
    )
    k_e = cfg.explore_slots_per_chunk
    assert k_e == 4
    model = make_net(0)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg)
    covered = None
    horizon = math.ceil(cfg.chunk_size / k_e)
    for step in range(1 + horizon):
        if not engine.in_warmup:
            used = torch.zeros(engine.buckets[0].layout.padded_numel, dtype=torch.bool)
            used[mask_positions(engine.current_masks()[0], cfg.chunk_size)] = True
            covered = used if covered is None else covered | used
        x, y = make_batch(0, step)
        (model(x) - y).pow(2).mean().backward()
        engine.step()
        engine.zero_grad()
    assert covered is not None and bool(covered.all())
    assert feedback.oldest_unsent_age(engine.buckets, engine.step_count, engine.in_warmup) <= horizon


def test_the_delayed_mask_is_the_one_built_a_step_earlier() -> None:
    for delay in (1,):
        spec = {
            "steps": 7,
            "config": {
                "density": 0.05,
                "chunk_size": 64,
                "dense_warmup_steps": 2,
                "density_ramp_steps": 0,
                "mask_delay": delay,
            },
        }
        out = sim(2, spec)[0]
        used, built = out["masks_used"], out["masks_built"]
        # built[j] was built at the end of step warmup + j (j = 0: the end of warm-up); used[i] is the mask
        # of step warmup + 1 + i, which must be the one built at the end of step warmup + 1 + i - delay.
        assert len(used) == 5
        for i in range(delay - 1, len(used)):
            for u, b in zip(used[i], built[i + 1 - delay], strict=True):
                assert torch.equal(u, b)
        assert any(not torch.equal(a, b) for a, b in zip(built[0], built[-1], strict=True))


def test_the_engine_compacts_with_the_queued_mask() -> None:
    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=1, density_ramp_steps=0, bucket_cap_mb=1.0)
    model = make_net(0, torch.float64)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg)
    for step in range(4):
        x, y = make_batch(0, step, torch.float64)
        queued = None if engine.in_warmup else engine.current_masks()[0].clone()
        (model(x) - y).pow(2).mean().backward()
        engine.step()
        engine.zero_grad()
        if queued is not None:
            res = engine.buckets[0].residual
            zero = res == 0
            pos = mask_positions(queued, cfg.chunk_size)
            assert bool(zero[pos].all())
            real = torch.zeros_like(zero)
            real[: engine.buckets[0].layout.numel] = True
            assert int((zero & real).sum()) <= pos.numel()  # zeros at the mask only


# ---------------------------------------------------------------- bytes


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_counters_equal_the_bytes_formula(world_size: int, sharded: bool) -> None:
    W = world_size
    spec = {
        "steps": 5,
        "config": {
            "density": 0.03,
            "chunk_size": 128,
            "dense_warmup_steps": 2,
            "density_ramp_steps": 0,
            "sharded": sharded,
        },
    }
    out = sim(W, spec)[0]
    N, n_real, b, bi = out["padded_numel"], out["numel"], 4, 2
    dN = out["slots"]
    cfg = ScapeConfig(**spec["config"])
    # Every chunk of a bucket has the slots of the bucket's chunk size (this tiny net's buckets use chunks
    # sized to the bucket, so that their padding stays within 5%: docs/algorithm.md section 3).
    assert dN == sum(P // C * cfg.slots_for(C) for P, C in out["layout"])
    assert N / n_real <= 1.05
    for step in range(5):
        sent = out["sent"][step]
        warm = step < 2
        if warm:
            expect_dense = (W - 1) * N * (b + b) // W if sharded else 2 * (W - 1) * N * b // W
            assert sent["dense"] == expect_dense and sent["values"] == 0
        else:
            assert sent["dense"] == 0
            if sharded:
                assert sent["values"] == (W - 1) * dN * b // W  # reduce-scatter
                assert sent["params"] == (W - 1) * dN * b // W  # all-gather of d N / W per rank
            else:
                assert sent["values"] == 2 * (W - 1) * dN * b // W and sent["params"] == 0
        # The mask built at the end of warm-up and of every sparse step (partitioned: sharded only).
        expect_idx = (W - 1) * dN * bi // W if (sharded and step >= 1) else 0
        assert sent["indices"] == expect_idx
        assert out["dense_eq"][step] == 2 * (W - 1) * n_real * b // W
    total = sum(out["sent"][-1].values())
    if sharded:
        assert total == (W - 1) * dN * (b + b + bi) // W  # docs/algorithm.md section 5, R = 1


def _toy_model(numel: int) -> nn.Sequential:
    """About ``numel`` parameters: 16 inputs, a hidden layer, one output (weights and biases)."""
    hidden = max(1, round((numel - 1) / 18))
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def _dense_step_bytes(rank: int, comm: Communicator, numel: int, sharded: bool) -> tuple[int, int, int]:
    model = _toy_model(numel)
    opt = AdamS(param_groups(model, 1e-3), lr=1e-3)  # weights and biases: two buckets, as LLM recipes group them
    engine = ScapeEngine(opt, ScapeConfig(sharded=sharded), comm, param_order=list(model.parameters()))
    model(torch.randn(4, 16)).square().mean().backward()
    engine.step()
    engine.close()
    assert engine.in_warmup  # the shipped default: 30 dense warm-up steps
    return engine.numel, engine.counters.total_sent["dense"], engine.counters.total_dense_equivalent


@pytest.mark.parametrize("numel", [700, 2_200, 4_300, 9_000])
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("sharded", [True, False])
def test_a_toy_model_sends_no_more_than_ddp_in_the_dense_warmup(numel: int, world_size: int, sharded: bool) -> None:
    """Shipped defaults (chunk_size 4096): a dense step sends DDP's 2 (W-1)/W N b for the N real parameters,
    plus at most 5% (the padding of the buckets to whole chunks), at any model size and world size."""
    W = world_size
    (n, dense, dense_equivalent), *_ = simulate(W, lambda rank, comm: _dense_step_bytes(rank, comm, numel, sharded))
    ddp = 2 * (W - 1) * n * 4 // W
    assert dense_equivalent == ddp
    assert ddp <= dense <= 1.05 * ddp, (n, dense / max(ddp, 1))


def test_chunks_are_sized_to_the_bucket_only_where_the_padding_would_exceed_five_percent() -> None:
    from lightning_scape.engine.layout import build_buckets

    def layout(*group_sizes: int, world_size: int = 2) -> list[tuple[int, int]]:
        """Per param group (one parameter each), its bucket's padded size and chunk size."""
        groups = [{"params": [nn.Parameter(torch.zeros(n))]} for n in group_sizes]
        buckets = sorted(build_buckets(groups, world_size, 4096, 25.0), key=lambda b: b.group_index)
        return [(b.padded_numel, b.chunk_size) for b in buckets]

    # The demo's model at W = 2: 856,064 matrix and 1,152 norm parameters, padded 1.3% in all: unchanged, so
    # it trains bitwise as before, even though its small bucket alone is mostly padding.
    assert layout(856_064, 1_152) == [(860_160, 4096), (8_192, 4096)]
    # A 4,300-parameter model: 8,192 at chunk 4096 (1.9x); its one chunk per shard is sized to the bucket.
    assert layout(4_300) == [(4_300, 2_150)]
    assert layout(4_300, world_size=4) == [(4_300, 1_075)]
    assert layout(20_000, world_size=8) == [(20_000, 2_500)]
    # Two buckets: the most padded one is sized first, and only as many as the model needs.
    assert layout(200_000, 300) == [(204_800, 4096), (300, 150)]
    # Padding below world_size elements per chunk of a shard: 30 parameters in 4 shards of 8.
    assert layout(30, world_size=4) == [(32, 8)]


def test_world_size_one_sends_nothing() -> None:
    out = sim(
        1, {"steps": 3, "config": {"density": 0.05, "chunk_size": 64, "dense_warmup_steps": 1, "density_ramp_steps": 0}}
    )[0]
    assert all(v == 0 for s in out["sent"] for v in s.values())


# ---------------------------------------------------------------- overlap, hooks, accumulation


class _SpyComm(SoloCommunicator):
    """World size 1, recording which parameters already had a gradient when each collective launched."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.launches: list[tuple[str, int]] = []
        self.grad_seen: set[int] = set()

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        self.launches.append(("reduce_scatter", len(self.grad_seen)))
        return super().reduce_scatter_sum(output, input)


class _Broken:
    """A collective whose wait fails, as a dead peer's does."""

    def wait(self) -> None:
        raise RuntimeError("peer gone")


class _BreakingComm(SoloCommunicator):
    """World size 1 whose reduce-scatters fail once ``broken`` is set, counting the waits on them."""

    def __init__(self) -> None:
        self.broken = False

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        return _Broken() if self.broken else super().reduce_scatter_sum(output, input)


def test_a_failed_collective_is_recorded_and_close_does_not_wait_on_it() -> None:
    """The engine records its own collectives' failures (nothing else has to), and then drops what is in flight."""
    net = make_net()
    comm = _BreakingComm()
    engine = ScapeEngine(AdamS(net.parameters(), lr=1e-2), ScapeConfig(density=0.1, chunk_size=64), comm)
    x, y = make_batch(0, 0)
    (net(x) - y).pow(2).mean().backward()
    engine.step()
    assert not engine.wire.failed
    comm.broken = True
    (net(x) - y).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="peer gone"):
        engine.step()
    assert engine.wire.failed
    engine.close()  # does not wait on (and raise from) the collectives still in flight


def test_bucket_collectives_launch_during_backward() -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    params = list(model.parameters())
    spy = _SpyComm(params)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: spy.grad_seen.add(id(p)))
    # 64*64*4 bytes = 16 KiB per weight: a 20 KiB cap gives one layer per bucket.
    cfg = ScapeConfig(density=0.1, chunk_size=64, dense_warmup_steps=0, bucket_cap_mb=20 / 1024)
    engine = ScapeEngine(AdamS(params, lr=1e-3), cfg, spy, param_order=params)
    assert len(engine.buckets) == 4
    model(torch.randn(8, 64)).square().mean().backward()
    # The first bucket (last layer) launched before the other layers' gradients existed.
    launched_at = [seen for _, seen in spy.launches]
    assert len(launched_at) == 4 and launched_at[0] < len(params)
    engine.step()


def test_unused_parameters_contribute_zeros_without_a_hang() -> None:
    """Rank 0 uses a branch that rank 1 skips: both still issue the same collectives in the same order."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            return self.b(self.a(x)) if use_b else self.a(x)

    cfg = ScapeConfig(
        density=0.25, chunk_size=16, dense_warmup_steps=1, density_ramp_steps=0, bucket_cap_mb=100 / 2**20
    )

    def worker(rank: int, comm: Communicator) -> torch.Tensor:
        torch.manual_seed(0)
        model = Branchy()
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm, param_order=list(model.parameters()))
        assert len(engine.buckets) > 1
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            model(x, use_b=(rank == 0)).square().mean().backward()
            engine.step()
            engine.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    a, b = simulate(2, worker, timeout_s=30)
    assert torch.equal(a, b)


def _two_pass_losses(net: nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    """Two micro-batches of a step, each loss halved (the accumulation of Lightning's manual-optimization docs)."""
    return [(net(x) - y).pow(2).mean() / 2 for x, y in (make_batch(rank, 2 * step), make_batch(rank, 2 * step + 1))]


@pytest.mark.parametrize("loss_scale", [None, 256.0])
@pytest.mark.parametrize("sharded", [True, False])
@pytest.mark.parametrize("dense_warmup_steps", [0, 4])
def test_two_backward_passes_per_step_add_up_as_under_ddp(
    dense_warmup_steps: int, sharded: bool, loss_scale: float | None
) -> None:
    """Two synchronised backward passes, then one step: DDP sums both passes' averaged gradients. At density 1
    (sparse steps) and in dense steps SCAPE must reproduce data-parallel AdamS on that sum, with fp16 loss
    scaling too."""
    W, steps = 2, 4
    cfg = ScapeConfig(
        density=1.0, chunk_size=32, dense_warmup_steps=dense_warmup_steps, exploration=0.0, sharded=sharded
    )
    scale = 1.0 if loss_scale is None else loss_scale

    def worker(rank: int, comm: Communicator) -> list[torch.Tensor]:
        net = make_net()
        engine = ScapeEngine(
            AdamS(param_groups(net, 1e-2), lr=1e-2), cfg, comm, param_order=list(net.parameters()),
            loss_scale=None if loss_scale is None else (lambda: scale), skip_nonfinite=loss_scale is not None,
        )  # fmt: skip
        trace = []
        for step in range(steps):
            for loss in _two_pass_losses(net, rank, step):
                (loss * scale).backward()
            engine.step()
            engine.zero_grad()
            trace.append(flat(net.parameters()))
        return trace

    out = simulate(W, worker)
    ref_net = make_net()
    ref = AdamS(param_groups(ref_net, 1e-2), lr=1e-2)
    for step in range(steps):
        grads = []
        for rank in range(W):
            ref_net.zero_grad()
            for loss in _two_pass_losses(ref_net, rank, step):
                loss.backward()
            grads.append([p.grad.clone() for p in ref_net.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(ref_net.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        ref.step()
        for rank_trace in out:
            assert rel_err(rank_trace[step], flat(ref_net.parameters())) < 1e-6, step


@pytest.mark.parametrize("sharded", [True, False])
def test_param_grad_holds_this_ranks_gradient_and_the_global_norm_is_the_averages(sharded: bool) -> None:
    """``param.grad`` is what backward computed on this rank, in dense and sparse steps, before and after the
    step; ``global_grad_norm`` is DDP's gradient norm (of the average) in dense steps. A write to ``param.grad``
    after backward changes nothing, and the engine says so."""
    cfg = ScapeConfig(density=0.1, chunk_size=64, dense_warmup_steps=2, density_ramp_steps=0, sharded=sharded)

    def worker(rank: int, comm: Communicator, clip: bool) -> dict[str, Any]:
        net = make_net()
        engine = ScapeEngine(AdamS(net.parameters(), lr=1e-2), cfg, comm, param_order=list(net.parameters()))
        out: dict[str, Any] = {"local": [], "norms": [], "written": []}
        for step in range(4):
            x, y = make_batch(rank, step)
            loss = (net(x) - y).pow(2).mean()
            local = torch.cat(
                [g.reshape(-1) for g in torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)]
            )
            loss.backward()
            out["norms"].append(engine.global_grad_norm())  # waits for the step's collectives
            assert torch.equal(torch.cat([p.grad.reshape(-1) for p in net.parameters()]), local), step  # type: ignore[union-attr]
            if clip and step == 3:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-4)  # in place, after the gradient was sent
            engine.step()
            out["written"].append(engine.grads_written_after_send)
            if not clip:
                assert torch.equal(torch.cat([p.grad.reshape(-1) for p in net.parameters()]), local), step  # type: ignore[union-attr]
            out["local"].append(local)
            engine.zero_grad()
        out["params"] = flat(net.parameters())
        return out

    plain, clipped = (simulate(2, lambda rank, comm, c=c: worker(rank, comm, c)) for c in (False, True))
    for step in range(2):  # dense steps: the norm of the average, as DDP's grad norm
        average = (plain[0]["local"][step] + plain[1]["local"][step]) / 2
        assert plain[0]["norms"][step] == pytest.approx(float(average.norm()), rel=1e-6)
    assert plain[0]["norms"] == plain[1]["norms"]
    assert plain[0]["local"][0].norm() != pytest.approx(plain[0]["norms"][0], rel=1e-3)  # a local norm differs
    for r in range(2):
        assert clipped[r]["written"] == [False, False, False, True] and not any(plain[r]["written"])
        assert torch.equal(clipped[r]["params"], plain[r]["params"])


def test_no_sync_accumulates_and_a_second_synced_backward_adds_up() -> None:
    cfg = ScapeConfig(density=1.0, chunk_size=32, dense_warmup_steps=0, exploration=0.0)
    model, twin = make_net(0), make_net(0)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg)
    ref = AdamS(twin.parameters(), lr=1e-2)
    x1, y1 = make_batch(0, 0)
    x2, y2 = make_batch(0, 1)
    with engine.no_sync():
        (model(x1) - y1).pow(2).mean().backward()
    (model(x2) - y2).pow(2).mean().backward()
    engine.step()
    ((twin(x1) - y1).pow(2).mean() + (twin(x2) - y2).pow(2).mean()).backward()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # Two synchronised backward passes (the first one sent, the second arriving at sent buckets) add up too.
    engine.zero_grad()
    twin.zero_grad()
    (model(x1) - y1).pow(2).mean().backward()
    (model(x2) - y2).pow(2).mean().backward()
    assert engine._step is not None and engine._step.rounds == 2
    engine.step()
    ((twin(x1) - y1).pow(2).mean() + (twin(x2) - y2).pow(2).mean()).backward()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_frozen_parameters_are_left_out_and_tied_parameters_count_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.frozen = nn.Linear(6, 6)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.frozen(self.emb(idx)))

    model = Tied()
    frozen_before = model.frozen.weight.detach().clone()
    engine = ScapeEngine(
        AdamS(model.parameters(), lr=1e-2),
        ScapeConfig(density=0.5, chunk_size=16, dense_warmup_steps=1, density_ramp_steps=0),
    )
    assert engine.numel == 60  # the tied 10x6 matrix once, nothing from the frozen layer
    for _ in range(3):
        model(torch.arange(10)).square().mean().backward()
        engine.step()
        engine.zero_grad()
    assert torch.equal(model.frozen.weight, frozen_before)
    assert model.head.weight is model.emb.weight


def test_clipping_scales_the_synchronised_gradient() -> None:
    """Dense warm-up (sharded: norm over shards) and density-1 sparse steps clip like clip_grad_norm_."""
    spec = {
        "steps": 6,
        "max_grad_norm": 1e-2,
        "config": {
            "density": 1.0,
            "chunk_size": 32,
            "dense_warmup_steps": 3,
            "density_ramp_steps": 0,
            "exploration": 0.0,
        },
    }
    ref = reference_dense_adams(spec, 2)
    unclipped = reference_dense_adams({**spec, "max_grad_norm": None}, 2)
    out = sim(2, spec)[0]["params"]
    for step in range(6):
        assert rel_err(out[step], ref[step]) < 1e-6, step
    assert rel_err(unclipped[-1], ref[-1]) > 1e-3  # the clip is active in this run


def test_engine_state_dict_resume_is_bitwise_identical() -> None:
    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=2, density_ramp_steps=0, bucket_cap_mb=1.0)

    def run(model: nn.Module, engine: ScapeEngine, steps: range) -> None:
        for step in steps:
            x, y = make_batch(0, step)
            (model(x) - y).pow(2).mean().backward()
            engine.step()
            engine.zero_grad()

    model = make_net(0)
    engine = ScapeEngine(AdamS(param_groups(model, 1e-2), lr=1e-2), cfg)
    run(model, engine, range(5))
    saved_params = {k: v.clone() for k, v in model.state_dict().items()}
    saved = engine.state_dict()
    run(model, engine, range(5, 9))

    twin = make_net(1)
    twin.load_state_dict(saved_params)
    twin_engine = ScapeEngine(AdamS(param_groups(twin, 1e-2), lr=1e-2), cfg)
    twin_engine.load_state_dict(saved)
    run(twin, twin_engine, range(5, 9))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="another configuration"):
        ScapeEngine(AdamS(make_net(0).parameters()), cfg.replace(density=0.1)).load_state_dict(saved)


def test_an_optimizer_without_adams_groups_is_refused() -> None:
    model = make_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"lightning_scape\.AdamS"):
        ScapeEngine(opt, ScapeConfig())


def test_construction_gives_every_rank_rank_zeros_parameters() -> None:
    """Like DDP's constructor: differently initialised replicas start identical (and the bytes are counted)."""
    cfg = ScapeConfig(density=0.05, chunk_size=64, dense_warmup_steps=1, density_ramp_steps=0)

    def worker(rank: int, comm: Communicator) -> tuple[torch.Tensor, dict[str, int], int]:
        model = make_net(seed=rank)  # a different initialisation on every rank
        engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm)
        return flat(model.parameters()), dict(engine.counters.total_sent), engine.padded_numel

    out = simulate(3, worker)
    expected = flat(make_net(seed=0).parameters())
    for params, sent, n in out:
        assert torch.equal(params, expected)
        assert sent["setup"] == 2 * (3 - 1) * n * 4 // 3 and sum(sent.values()) == sent["setup"]

    def unsynced(rank: int, comm: Communicator) -> torch.Tensor:
        model = make_net(seed=rank)
        ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, comm, sync_params=False)
        return flat(model.parameters())

    a, b, _ = simulate(3, unsynced)
    assert not torch.equal(a, b)


def test_a_group_that_joins_late_counts_its_bias_corrections_from_its_first_step_as_adamw() -> None:
    """A param group added after three steps (what BaseFinetuning does) takes AdamW's first two steps exactly, as
    torch's AdamW counts each parameter's steps: with the run's step count its first step moved every coordinate by
    (1 - b1) / sqrt(1 - b2_t) lr (3.0 lr here at b2 = 0.999) instead of lr."""
    torch.manual_seed(0)
    head, backbone = nn.Linear(4, 3), nn.Linear(5, 4)
    twin = nn.Linear(5, 4)
    twin.load_state_dict(backbone.state_dict())
    backbone.requires_grad_(False)
    opt = AdamS(head.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    engine = ScapeEngine(opt, ScapeConfig(), SoloCommunicator(), list(head.parameters()) + list(backbone.parameters()))
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    for step in range(5):
        if step == 3:  # unfreeze the backbone: it joins the engine in a bucket of its own
            backbone.requires_grad_(True)
            opt.add_param_group({"params": list(backbone.parameters())})
            assert engine.add_trainable_params() == 24 and engine.buckets[-1].first_step == 3
        x = torch.randn(8, 5) * 10.0**step  # a growing input: a growing gradient
        if step >= 3:  # the same gradient for the twin, through the same head, before anything steps
            reference.zero_grad()
            head(torch.tanh(twin(x))).square().mean().backward(inputs=list(twin.parameters()))
        head(torch.tanh(backbone(x))).square().mean().backward()
        engine.step()
        engine.zero_grad()
        if step >= 3:
            reference.step()
            torch.testing.assert_close(flat(backbone.parameters()), flat(twin.parameters()), rtol=0, atol=1e-6)
    state = engine.state_dict()
    assert [b["first_step"] for b in state["buckets"]] == [0, 3]
    engine.load_state_dict(state)  # it resumes with its own count
    assert engine.buckets[-1].first_step == 3
    state["buckets"][-1]["first_step"] = 6  # after the state's step 5: not a step it could have joined at
    with pytest.raises(ValueError, match="bucket 1 joined at step 6"):
        engine.check_state_dict(state)
