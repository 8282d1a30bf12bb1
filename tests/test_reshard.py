"""Re-sharding a SCAPE state to another world size, in one process (the thread simulation) and on files.

A run on W ranks saves every rank's state; a run on W' ranks builds each new rank's state from all of them
(``ScapeEngine.reshard_state_dicts``) and loads it. The tests check the pieces exactly: the momentum and
last-sent steps land at their global coordinates, the global unsent gradient (the mean over ranks of the
residuals) is unchanged, the masks are rebuilt from the restored statistics at the resumed step's density,
and, with integer fp64 gradients, no gradient mass is lost over a run that changes its world size.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers import make_net as make_model
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_scape import AdamS, ScapeConfig, ScapeEngine, simulate
from lightning_scape.comm import Communicator
from lightning_scape.kernels import mask_positions, select_mask
from lightning_scape.runtime import checkpoint_protocol

# Several buckets (bucket_cap_mb ~ 1.5k fp64 values), chunks of 64 with 3 slots, a warm-up of 2 steps and a
# density ramp over steps 3..5, so a resume after step 4 lands mid-ramp.
CFG = {
    "density": 0.05,
    "chunk_size": 64,
    "dense_warmup_steps": 2,
    "density_ramp_steps": 4,
    "exploration": 0.25,
    "bucket_cap_mb": 0.012,
}


def _engine(
    comm: Communicator | None, cfg: ScapeConfig, params: list[torch.Tensor] | None = None
) -> tuple[torch.nn.Module, ScapeEngine]:
    model = make_model(0, torch.float64)
    if params is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), params, strict=True):
                p.copy_(q)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-3), cfg, comm, param_order=list(model.parameters()))
    return model, engine


def _train(engine: ScapeEngine, rank: int, world_size: int, steps: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """``steps`` steps of integer fp64 gradients; per bucket, sum g / W and (what was sent) / W, exact.

    What a rank sends is its whole gradient in a dense step and ``(e + g)[mask]`` in a sparse one (recorded
    before the step: replicated mode all-reduces the buffers in place; not recorded with ``mask_delay=0``, whose
    mask is built inside the step).
    """
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    grads = [torch.zeros_like(bs.residual) for bs in engine.buckets]
    sent = [torch.zeros_like(bs.residual) for bs in engine.buckets]
    for _ in range(steps):
        for bs in engine.buckets:
            for place in bs.layout.places:
                assert place.param.grad is not None  # a view into the bucket's gradient buffer
                place.param.grad.copy_(torch.randint(-1000, 1000, place.param.shape, generator=gen))
        masks = None if engine.in_warmup or engine.config.mask_delay == 0 else engine.current_masks()
        for i, bs in enumerate(engine.buckets):
            grads[i] += bs.grads / world_size
            if engine.config.mask_delay == 0 and not engine.in_warmup:
                continue
            if masks is None:
                sent[i] += bs.grads / world_size
            else:
                pos = mask_positions(masks[i], bs.layout.chunk_size)
                sent[i].index_add_(0, pos, (bs.residual + bs.grads)[pos] / world_size)
        engine.step()  # no backward: the step synchronises the gradients it finds
        engine.zero_grad()
    return {"grads": grads, "sent": sent}


def _first_run(world_size: int, cfg: ScapeConfig, steps: int) -> list[dict[str, Any]]:
    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        model, engine = _engine(comm, cfg)
        out = _train(engine, rank, world_size, steps, seed=1)
        out["state"] = engine.state_dict()
        out["params"] = [p.detach().clone() for p in model.parameters()]
        engine.close()
        return out

    return simulate(world_size, worker)


def _resumed_run(world_size: int, cfg: ScapeConfig, first: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    saved = [r["state"] for r in first]

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        model, engine = _engine(comm, cfg, first[0]["params"])
        engine.load_state_dict(engine.reshard_state_dicts(iter(saved)))
        loaded = {
            "momentum": [bs.momentum.clone() for bs in engine.buckets],
            "last_sent": [bs.last_sent.clone() for bs in engine.buckets],
            "residual": [bs.residual.clone() for bs in engine.buckets],
            "region": [bs.region for bs in engine.buckets],
            "shard": [bs.shard for bs in engine.buckets],
            "padded": [bs.layout.padded_numel for bs in engine.buckets],
            "chunk": [bs.layout.chunk_size for bs in engine.buckets],
            "masks": [m.clone() for m in engine.current_masks()] if not engine.in_warmup else None,
            "step_count": engine.step_count,
            "refresh_count": engine.refresh_count,
            "total_sent": dict(engine.counters.total_sent),
        }
        out = _train(engine, rank, world_size, steps, seed=2)
        out["loaded"] = loaded
        out["residual"] = [bs.residual.clone() for bs in engine.buckets]
        out["params"] = [p.detach().clone() for p in model.parameters()]
        engine.close()
        return out

    return simulate(world_size, worker)


def _global(parts: list[torch.Tensor], regions: list[slice], padded: int) -> torch.Tensor:
    """The regions of one bucket on every rank, written at their global coordinates."""
    out = torch.zeros(padded, dtype=parts[0].dtype)
    for part, region in zip(parts, regions, strict=True):
        out[region] = part
    return out


@pytest.mark.parametrize(
    ("old", "new", "extra"),
    [
        (2, 1, {}),
        (2, 4, {}),
        (4, 2, {}),
        (1, 4, {"catch_up_cap": 4.0}),
        (4, 1, {"sharded": False}),
        (2, 4, {"sharded": False}),  # replicated momentum statistic: masks computed locally, nothing gathered
    ],
)
def test_reshard_moves_every_piece_of_state_and_loses_no_gradient_mass(
    old: int, new: int, extra: dict[str, Any]
) -> None:
    cfg = ScapeConfig(**CFG, **extra)
    first = _first_run(old, cfg, steps=4)
    resumed = _resumed_run(new, cfg, first, steps=5)
    n_buckets = len(first[0]["state"]["buckets"])
    assert n_buckets >= 3
    layout = first[0]["state"]["layout"]
    for i in range(n_buckets):
        numel, old_padded = layout[i][1], layout[i][2]
        new_padded = resumed[0]["loaded"]["padded"][i]
        assert new_padded % new == 0 and new_padded >= numel
        old_regions = [bs_region(cfg, old, r, old_padded) for r in range(old)]
        new_regions = [r["loaded"]["region"][i] for r in resumed]
        for key in ("momentum", "last_sent"):
            before = _global([r["state"]["buckets"][i][key] for r in first], old_regions, old_padded)
            after = _global([r["loaded"][key][i] for r in resumed], new_regions, new_padded)
            # 1. Momentum and last-sent steps at the same global coordinates; the new padding is zero
            #    momentum and "sent at the resume step".
            assert torch.equal(after[:numel], before[:numel]), (i, key)
            fill = 0.0 if key == "momentum" else 4.0
            assert bool((after[numel:] == fill).all()), (i, key)
        assert float(first[0]["state"]["buckets"][i]["momentum"].abs().sum()) > 0
        # 2. The global unsent gradient, the mean over ranks of the residuals, is unchanged, exactly; every
        #    coordinate's new owner holds what its old owner held (on one rank: the mean itself).
        old_shards = [slice(r * old_padded // old, (r + 1) * old_padded // old) for r in range(old)]
        mean_before = sum(r["state"]["buckets"][i]["residual"][:numel] for r in first) / old
        mean_after = sum(r["loaded"]["residual"][i] for r in resumed) / new
        assert torch.equal(mean_after[:numel], mean_before) and not mean_after[numel:].any()
        saved = [r["state"]["buckets"][i]["residual"][s] for r, s in zip(first, old_shards, strict=True)]
        owned_before = _global(saved, old_shards, old_padded)[:numel]
        owned_after = _global([r["loaded"]["residual"][i][r["loaded"]["shard"][i]] for r in resumed],
                              [r["loaded"]["shard"][i] for r in resumed], new_padded)  # fmt: skip
        assert torch.equal(owned_after[:numel], owned_before if new > 1 else mean_before)
        assert mean_before.abs().sum() > 0
        # 3. No mass lost across the resume: sum over steps and ranks of g / W_t = what was sent (averaged the
        #    same way) + the mean residual of the ranks at the end.
        grads = sum(r["grads"][i][:numel] for r in first) + sum(r["grads"][i][:numel] for r in resumed)
        sent = sum(r["sent"][i][:numel] for r in first) + sum(r["sent"][i][:numel] for r in resumed)
        residual = sum(r["residual"][i][:numel] for r in resumed) / new
        assert torch.equal(grads, sent + residual), i
        assert residual.abs().sum() > 0
    # 4. The step and the mask schedule continue: the rebuilt masks are those of the restored statistics at
    #    step 5's ramp density; they replace the last built ones (same refresh index, same count).
    saved_refresh = first[0]["state"]["refresh_count"]
    # Chunk sizes per bucket (a small model's buckets may use chunks smaller than chunk_size).
    chunks = resumed[0]["loaded"]["chunk"]
    ks = [cfg.slots_at(5, C) for C in chunks]
    assert all(k > cfg.slots_for(C) for k, C in zip(ks, chunks, strict=True))
    gathered = cfg.sharded  # else every rank computes the whole mask
    rebuild = sum((new - 1) * p // new // C * k * 2
                  for p, C, k in zip(resumed[0]["loaded"]["padded"], chunks, ks, strict=True))  # fmt: skip
    for rank, r in enumerate(resumed):
        assert r["loaded"]["step_count"] == 4 and r["loaded"]["refresh_count"] == saved_refresh
        # The byte counters continue those of the old rank with the same index (the last one beyond), plus the
        # index all-gather of the rebuilt masks.
        expected = dict(first[min(rank, old - 1)]["state"]["counters"]["total_sent"])
        expected["indices"] += rebuild if gathered else 0
        assert r["loaded"]["total_sent"] == expected
    for i in range(n_buckets):
        masks = [r["loaded"]["masks"][i] for r in resumed]
        assert all(torch.equal(m, masks[0]) for m in masks)  # every rank holds the whole mask
        new_padded = resumed[0]["loaded"]["padded"][i]
        momentum = _global([r["loaded"]["momentum"][i] for r in resumed],
                           [r["loaded"]["region"][i] for r in resumed], new_padded)  # fmt: skip
        owned = _global([r["loaded"]["residual"][i][r["loaded"]["shard"][i]] for r in resumed],
                        [r["loaded"]["shard"][i] for r in resumed], new_padded)  # fmt: skip
        C, k = chunks[i], ks[i]
        ke, offset = cfg.explore_slots(k), (saved_refresh - 1) * cfg.explore_slots(k) % C
        if cfg.sharded:  # chunks are global: per-shard builds = one build
            expected = select_mask(momentum, owned, 0.9, "momentum", C, k, ke, offset)
        else:  # replicated momentum statistic: |m| on every rank (select_mask's "gradient" statistic of m)
            expected = select_mask(momentum, momentum, 0.9, "gradient", C, k, ke, offset)
        assert torch.equal(masks[0], expected), i
        # Where the statistics are those the old owners scored, the rebuilt mask is the one the uninterrupted run
        # built for step 5 (on the chunks both layouts have).
        saved_mask = first[0]["state"]["buckets"][i]["masks"][0]
        same_chunks = first[0]["state"]["layout"][i][2] // len(saved_mask) == C
        if cfg.mask_delay == 1 and (new > 1 or not gathered) and same_chunks:
            rows = min(len(saved_mask), len(masks[0]))
            assert torch.equal(masks[0][:rows], saved_mask[:rows]), i
    # 5. The continuation is a consistent SCAPE run: replicas identical on every new rank.
    for r in resumed[1:]:
        assert all(torch.equal(p, q) for p, q in zip(r["params"], resumed[0]["params"], strict=True))


def bs_region(cfg: ScapeConfig, world_size: int, rank: int, padded: int) -> slice:
    """The region of ``rank`` in a bucket padded to ``padded`` on ``world_size`` ranks."""
    if not cfg.sharded:
        return slice(0, padded)
    shard = padded // world_size
    return slice(rank * shard, (rank + 1) * shard)


def test_resharding_onto_the_same_world_size_continues_exactly_as_the_saved_states() -> None:
    """W' = W: each rank gets its own residual back on its shard and the other ranks' sum elsewhere (exact in
    fp64 with integer gradients), the rebuilt masks are the saved ones: the run continues bitwise alike."""
    cfg = ScapeConfig(**CFG)
    first = _first_run(2, cfg, steps=4)

    def worker(rank: int, comm: Communicator, reshard: bool) -> list[torch.Tensor]:
        model, engine = _engine(comm, cfg, first[0]["params"])
        saved = [r["state"] for r in first]
        engine.load_state_dict(engine.reshard_state_dicts(saved) if reshard else saved[rank])
        _train(engine, rank, 2, steps=4, seed=2)
        out = [p.detach().clone() for p in model.parameters()] + [bs.residual.clone() for bs in engine.buckets]
        engine.close()
        return out

    direct = simulate(2, lambda rank, comm: worker(rank, comm, False))
    resharded = simulate(2, lambda rank, comm: worker(rank, comm, True))
    for a, b in zip(direct, resharded, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_masks_built_in_the_backward_resume_on_another_world_size() -> None:
    """``mask_delay=0`` builds the first mask of the resumed run in its backward pass, one refresh per step."""
    cfg = ScapeConfig(**{**CFG, "mask_delay": 0})
    first = _first_run(2, cfg, steps=5)
    saved = [r["state"] for r in first]

    def worker(rank: int, comm: Communicator) -> dict[str, Any]:
        model, engine = _engine(comm, cfg, first[0]["params"])
        engine.load_state_dict(engine.reshard_state_dicts(saved))
        refresh = engine.refresh_count
        _train(engine, rank, 4, steps=3, seed=2)
        out = {"refresh": refresh, "after": engine.refresh_count,
               "params": [p.detach().clone() for p in model.parameters()]}  # fmt: skip
        engine.close()
        return out

    resumed = simulate(4, worker)
    q = first[0]["state"]["refresh_count"]
    for r in resumed:
        assert all(torch.equal(p, q_) for p, q_ in zip(r["params"], resumed[0]["params"], strict=True))
        assert r["refresh"] == q and r["after"] == q + 3  # built in the backward of each of the 3 steps


def test_a_resume_during_the_warmup_stays_dense_and_builds_the_first_mask_at_its_end() -> None:
    cfg = ScapeConfig(**{**CFG, "dense_warmup_steps": 3, "density_ramp_steps": 0})
    first = _first_run(2, cfg, steps=1)
    resumed = _resumed_run(4, cfg, first, steps=3)
    for r in resumed:
        assert r["loaded"]["masks"] is None and r["loaded"]["step_count"] == 1
        assert all(not e.any() for e in r["loaded"]["residual"])  # dense steps leave no residual
        assert all(not s.any() for s in r["loaded"]["last_sent"])
    layout = first[0]["state"]["layout"]
    for i, (_, numel, _) in enumerate(layout):
        # Two more dense steps, then step 4 is sparse: what was sent is everything but the residual.
        grads = sum(r["grads"][i][:numel] for r in first) + sum(r["grads"][i][:numel] for r in resumed)
        sent = sum(r["sent"][i][:numel] for r in first) + sum(r["sent"][i][:numel] for r in resumed)
        assert torch.equal(grads, sent + sum(r["residual"][i][:numel] for r in resumed) / 4)


# ----------------------------------------------------------------------------------- refusals


def test_states_that_cannot_be_resharded_are_refused_naming_what_differs() -> None:
    cfg = ScapeConfig(**CFG)
    first = _first_run(2, cfg, steps=3)
    saved = [r["state"] for r in first]
    _, engine = _engine(None, cfg)  # world size 1
    before = [bs.momentum.clone() for bs in engine.buckets]
    # Loading another world size's state directly says how to re-shard it.
    with pytest.raises(ValueError, match=r"rank 0 of 2, but this is rank 0 of 1.*reshard_state_dicts"):
        engine.load_state_dict(saved[0])
    with pytest.raises(ValueError, match=r"another configuration .*'density': \(0.05, 0.1\)"):
        _engine(None, cfg.replace(density=0.1))[1].reshard_state_dicts(saved)
    # Another model: the layout names the param group and real size of every bucket.
    wider = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8)).double()
    other = ScapeEngine(AdamS(wider.parameters(), lr=1e-3), cfg)
    with pytest.raises(ValueError, match=r"another bucket layout .*\(param group, parameters\) per bucket \[\(0, "):
        other.reshard_state_dicts(saved)
    with pytest.raises(ValueError, match="got 1 rank states of a run on 2 ranks; all 2 are needed"):
        engine.reshard_state_dicts(saved[:1])
    with pytest.raises(ValueError, match="expected the state of rank 0 of 2, got rank 1 of 2"):
        engine.reshard_state_dicts(saved[::-1])
    later = _first_run(2, cfg, steps=4)[1]["state"]
    with pytest.raises(ValueError, match=r"rank 1 is at step 4.*different saves"):
        engine.reshard_state_dicts([saved[0], later])
    broken = {**saved[1], "buckets": [{**b, "residual": b["residual"][:-1]} for b in saved[1]["buckets"]]}
    with pytest.raises(ValueError, match="bucket 0 residual"):
        engine.reshard_state_dicts([saved[0], broken])
    # Nothing was loaded by any of these.
    assert engine.step_count == 0
    assert all(torch.equal(a, bs.momentum) for a, bs in zip(before, engine.buckets, strict=True))
    engine.close()


def _write_checkpoint(path: str, states: list[dict[str, Any]], save_id: str) -> dict[str, Any]:
    """A Fabric-style checkpoint of ``len(states)`` ranks: the main file with its stub, and the rank files."""
    io = TorchCheckpointIO()
    fulls = [{"state": {}, "param_groups": [{"lr": 1e-3, "params": [0]}], "scape": s} for s in states]
    stub = checkpoint_protocol.make_stub(fulls[0], save_id)
    io.save_checkpoint({"optimizer": stub}, path)
    for rank, full in enumerate(fulls):
        checkpoint_protocol.save_rank_states(io, path, rank, len(states), {"optimizer": full}, save_id)
    return stub


def test_checkpoint_files_of_another_world_size_are_read_one_by_one_and_checked(tmp_path: Any) -> None:
    cfg = ScapeConfig(**CFG)
    first = _first_run(2, cfg, steps=4)
    path = str(tmp_path / "run.ckpt")
    stub = _write_checkpoint(path, [r["state"] for r in first], "id-1")
    io = TorchCheckpointIO()
    _, engine = _engine(None, cfg, first[0]["params"])
    loaded = checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1, engines={"optimizer": engine})
    assert checkpoint_protocol.stub_world_size(stub) == 2
    engine.load_state_dict(loaded["optimizer"]["scape"])
    for i, bs in enumerate(engine.buckets):
        numel = bs.layout.numel
        assert torch.equal(bs.residual[:numel], sum(r["state"]["buckets"][i]["residual"][:numel] for r in first) / 2)
    # Without the engines a checkpoint of another world size is still refused.
    with pytest.raises(ValueError, match="written by 2 ranks, but this run has 1"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1)
    # A rank file of another save, a missing one, a truncated one: refused, naming the file.
    other = str(tmp_path / "other.ckpt")
    _write_checkpoint(other, [r["state"] for r in first], "id-2")
    os.replace(
        checkpoint_protocol.rank_state_path(other, 1, "id-2"), checkpoint_protocol.rank_state_path(path, 1, "id-1")
    )
    with pytest.raises(ValueError, match=r"rank-00001\.pt' does not belong"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1, engines={"optimizer": engine})
    os.remove(checkpoint_protocol.rank_state_path(path, 1, "id-1"))
    with pytest.raises(FileNotFoundError, match=r"rank 1 \(of 2: re-sharding reads every rank's file\) is missing"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1, engines={"optimizer": engine})
    _write_checkpoint(path, [r["state"] for r in first], "id-1")
    with open(checkpoint_protocol.rank_state_path(path, 1, "id-1"), "r+b") as f:
        f.truncate(200)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 .*rank-00001\.pt.*truncated or corrupt"):
        checkpoint_protocol.load_rank_states(io, path, {"optimizer": stub}, 0, 1, engines={"optimizer": engine})
    engine.close()
