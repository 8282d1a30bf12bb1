"""CommunicationMonitor and MaskMonitor: their logged values equal what the engine counted.

The Trainer run (the "main" scenario of ``test_strategy_trainer``) logs through a CSVLogger every step; a
recording callback kept the engine's own numbers on both ranks, so every logged value is checked against an
independent copy. The Fabric run (the "f_main" scenario of ``test_strategy_fabric``) logs the dicts that
``compute()`` returned. The coverage and churn arithmetic is checked in-process on a
hand-made gradient and mask.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
import torch
from helpers import SCAPE, load_outputs

from lightning_scape import AdamS, CommunicationMonitor, MaskMonitor, ScapeConfig, ScapeEngine
from lightning_scape.comm import TRAFFIC_KINDS
from lightning_scape.examples.run_plot import plot_metrics_csv, read_metrics_csv
from lightning_scape.kernels import mask_positions
from lightning_scape.pytorch.monitors import topk_coverage


def csv_rows(logdir: str) -> dict[int, dict[str, float]]:
    """Per step, the monitors' keys of the CSV log."""
    rows: dict[int, dict[str, float]] = {}
    with open(os.path.join(logdir, "csv", "version_0", "metrics.csv")) as f:
        for row in csv.DictReader(f):
            vals = {k: float(v) for k, v in row.items() if v != "" and k.startswith(("comm/", "mask/"))}
            if vals:
                rows.setdefault(int(row["step"]), {}).update(vals)
    return rows


def masks_positions(masks: list[torch.Tensor], chunk_size: int) -> set[int]:
    out: set[int] = set()
    for i, m in enumerate(masks):
        out |= {i * 10**9 + int(p) for p in mask_positions(m, chunk_size)}
    return out


@pytest.mark.dist
def test_trainer_monitors_log_the_engine_counters(trainer_runs: str) -> None:
    out = load_outputs(trainer_runs, "main")
    rec0, rec1 = out[0]["steps"], out[1]["steps"]
    rows = csv_rows(os.path.join(trainer_runs, "logs"))
    assert sorted(rows) == [r["global_step"] for r in rec0]  # log_every_n_steps=1: one row per optimizer step
    chunk = ScapeConfig(**SCAPE).chunk_size
    previous: set[int] | None = None
    for a, b in zip(rec0, rec1, strict=True):
        row = rows[a["global_step"]]
        assert row["comm/sent_bytes"] == sum(a["sent"].values()) == sum(b["sent"].values())
        assert not any(key.startswith("comm/received") for key in row)  # ring collectives: received == sent
        for kind in TRAFFIC_KINDS:
            assert row[f"comm/sent_bytes/{kind}"] == a["sent"][kind]
        assert row["comm/dense_equivalent_bytes"] == a["dense_equivalent"]
        assert row["comm/compression_ratio"] == pytest.approx(a["dense_equivalent"] / sum(a["sent"].values()))
        assert row["comm/wait_s"] == pytest.approx((a["wait_s"] + b["wait_s"]) / 2, rel=1e-9, abs=1e-12)
        assert row["comm/wait_s_max"] == pytest.approx(max(a["wait_s"], b["wait_s"]), rel=1e-9, abs=1e-12)
        assert row["comm/total_sent_bytes"] == a["total_sent"]
        assert row["comm/total_dense_equivalent_bytes"] == a["total_dense_equivalent"]
        if a["masks"] is None:  # dense warm-up: no mask keys
            assert not any(k.startswith("mask/") for k in row)
            continue
        assert row["mask/residual_norm"] == pytest.approx((a["residual_norm"] + b["residual_norm"]) / 2, rel=1e-9)
        assert row["mask/oldest_unsent_age"] == max(a["oldest"], b["oldest"])
        current = masks_positions(a["masks"], chunk)
        if previous is not None:
            kept = len(current & previous) / len(current)
            assert row["mask/kept_fraction"] == pytest.approx(kept, rel=1e-12)
            assert row["mask/jaccard"] == pytest.approx(len(current & previous) / len(current | previous), rel=1e-12)
            assert any(k.startswith("mask/churn/net.") for k in row)
        previous = current
        if a["step_count"] % 2 == 0:
            assert 0.0 <= row["mask/topk_coverage"] <= 1.0
    # The progress bar shows the last step's ratio under a key a terminal does not cut ("comm/compression..." was).
    last = rec0[-1]
    assert out[0]["progress_bar"]["DDP/sent"] == pytest.approx(last["dense_equivalent"] / sum(last["sent"].values()))
    assert not any(key.startswith("comm/") for key in out[0]["progress_bar"])


@pytest.mark.dist
def test_the_demo_plot_draws_the_logged_trainer_run(trainer_runs: str, tmp_path: Path) -> None:
    """``lightning-scape plot`` on the CSVLogger's file of a real fit: SCAPE's bytes and DDP's, as logged."""
    metrics = Path(trainer_runs) / "logs" / "csv" / "version_0" / "metrics.csv"
    rows = csv_rows(str(Path(trainer_runs) / "logs"))
    run, ddp = read_metrics_csv(metrics)
    logged = sorted(step for step, row in rows.items() if "comm/sent_bytes" in row)
    assert run.sent == (logged, [rows[s]["comm/sent_bytes"] for s in logged])
    assert ddp.sent == (logged, [rows[s]["comm/dense_equivalent_bytes"] for s in logged])
    assert run.val  # the fit logs val_loss (and no train loss: LitModel does not log one)
    png = plot_metrics_csv(metrics, tmp_path / "fit.png")
    assert png.read_bytes().startswith(b"\x89PNG")


@pytest.mark.dist
def test_fabric_monitors_return_the_engine_counters(fabric_runs: str) -> None:
    for o in load_outputs(fabric_runs, "f_main"):
        for logged, recorded in zip(o["logged"], o["recorded"], strict=True):
            assert logged["comm/sent_bytes"] == recorded["sent"]
            assert logged["comm/sent_bytes/values"] == recorded["values"]
            assert logged["comm/dense_equivalent_bytes"] == recorded["dense_equivalent"]
            assert logged["comm/wait_s_max"] >= recorded["wait_s"] >= 0.0
        sparse = [lg for lg in o["logged"] if "mask/residual_norm" in lg]
        assert len(sparse) == 6  # 8 steps, 2 dense
        assert all("mask/kept_fraction" in lg for lg in sparse[1:])
        assert all(math.isfinite(lg["comm/compression_ratio"]) and lg["comm/compression_ratio"] > 1 for lg in sparse)


def _engine_with(model: torch.nn.Module, grads: list[torch.Tensor]) -> ScapeEngine:
    """A one-process engine (chunks of 16, 2 slots each) whose gradient buffers hold ``grads``."""
    cfg = ScapeConfig(density=0.125, chunk_size=16, dense_warmup_steps=0, exploration=0.0)
    engine = ScapeEngine(AdamS(model.parameters(), lr=1e-2), cfg, param_order=list(model.parameters()))
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.grad is not None
        p.grad.copy_(g)
    return engine


def test_topk_coverage_counts_the_true_topk_inside_the_mask() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = _engine_with(model, [torch.randn(p.shape) for p in model.parameters()])
    (bs,) = engine.buckets
    pos = mask_positions(engine.current_masks()[0], 16)
    real = pos[pos < bs.layout.numel]
    top = set(bs.grads[: bs.layout.numel].abs().topk(real.numel()).indices.tolist())
    assert topk_coverage(engine, [pos]) == pytest.approx(len(top & set(real.tolist())) / real.numel())
    # A mask made of the true top-k covers all of it.
    assert topk_coverage(engine, [torch.tensor(sorted(top))]) == 1.0
    engine.close()


def test_mask_monitor_overlap_and_churn_by_brute_force() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    engine = _engine_with(model, [torch.zeros(p.shape) for p in model.parameters()])
    (bs,) = engine.buckets
    monitor = MaskMonitor(per_layer=True)
    monitor.set_parameter_names(model)
    rows = bs.layout.chunks
    first = torch.tensor([[0, 1]] * rows, dtype=torch.int16)
    second = torch.tensor([[0, 2]] * rows, dtype=torch.int16)  # one of the two slots of every chunk moves
    for mask in (first, second):
        engine.last_used_masks = [mask]
        monitor.update(engine)
    logged = monitor.compute()
    assert logged["mask/kept_fraction"] == pytest.approx(0.5)
    assert logged["mask/jaccard"] == pytest.approx(1 / 3)
    names = {id(p): n for n, p in model.named_parameters()}
    old = set(mask_positions(first, 16).tolist())
    for place in bs.layout.places:
        mine = [q for q in mask_positions(second, 16).tolist() if place.offset <= q < place.offset + place.numel]
        expect = sum(q not in old for q in mine) / len(mine)
        assert logged[f"mask/churn/{names[id(place.param)]}"] == pytest.approx(expect)
    assert set(logged) >= {"mask/residual_norm", "mask/oldest_unsent_age"}
    engine.close()


def test_monitors_validate_their_arguments_and_log_nothing_before_a_step() -> None:
    assert CommunicationMonitor().compute() == {}
    with pytest.raises(ValueError, match="log_every_n_steps"):
        CommunicationMonitor(log_every_n_steps=0)
    with pytest.raises(ValueError, match="topk_every_n_steps"):
        MaskMonitor(topk_every_n_steps=0)
