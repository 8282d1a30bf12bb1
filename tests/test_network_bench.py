"""Smoke test of the network benchmark harness (``benchmarks/network``).

The harness itself runs on loopback here (``--loopback``: no root, no namespaces, so nothing can be left
behind); the full benchmark is a command (``docs/benchmarks.md``), not a test. Where the machine allows
network namespaces, a second test builds a 2-host emulated network and checks that it is shaped and
that nothing of it remains afterwards.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.network.netns import (
    EmulatedNetwork,
    list_links,
    list_netns,
    measure_throughput,
    netns_unavailable_reason,
    parse_profile,
)
from benchmarks.network.worker import ALL_METHODS, COMPUTE_ONLY

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[1]  # the benchmarks run as modules from here


def test_harness_smoke_on_loopback(tmp_path: Path) -> None:
    """Every method of ``--methods all`` runs 4 steps on 2 ranks; outputs exist, are marked loopback, and add up."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.network.run",
        "--loopback",
        "--model",
        "tiny",
        "--steps",
        "4",
        "--warmup",
        "2",
        "--batch-size",
        "2",
        "--block-size",
        "32",
        "--chunk-size",
        "256",
        "--max-bytes",
        "200000",
        "--timeout-s",
        "120",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "LIGHTNING_SCAPE_CACHE": str(tmp_path / "cache")}  # the ranks' token cache, not ~/.cache
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "running on loopback WITHOUT any rate limit" in proc.stdout

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["emulated"] is False
    assert "LOOPBACK, NO RATE LIMIT" in (tmp_path / "results.md").read_text()
    with open(tmp_path / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["method"] for r in rows] == list(ALL_METHODS)
    assert {r["network"] for r in rows} == {"loopback-unlimited"}
    for png in ("step_time_vs_bandwidth.png", "loopback/loss_vs_step.png", "loopback/loss_vs_time.png"):
        assert (tmp_path / png).stat().st_size > 1000, png

    per = results["profiles"][0]["summary"]["per_method"]
    for name, p in per.items():
        assert p["step_ms_median"] > 0 and p["tokens_per_s"] > 0, name
        assert len(p["loss_curve"]) == 4 and all(math.isfinite(v) for v in p["loss_curve"]), name
        assert math.isnan(p["tx_bytes_kernel"]), name  # lo is shared: never reported as this rank's
        if name == COMPUTE_ONLY:
            assert p["sent_bytes_counters"] == 0
        else:
            # The package's counters (SCAPE: the engine's; DDP: its hooks' all-reduces) equal the formula.
            assert p["sent_bytes_counters"] == p["formula_bytes"] > 0, name
    # Same model, data and seed: the first step's loss is the same for every method.
    first = {round(p["loss_curve"][0], 4) for p in per.values()}
    assert len(first) == 1, first
    # Sparse methods send far less than DDP.
    assert per["scape_sharded_d0.01"]["sent_bytes_counters"] * 10 < per["ddp_adamw"]["sent_bytes_counters"]


def _namespaces_work() -> str | None:
    """None if this process may create network namespaces, else why not."""
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    name = f"lsbench{os.getpid()}-999"  # the harness's pattern, so that a leftover is cleaned as stale
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def test_hosts_of_two_ranks_shard_inside_and_replicate_across(tmp_path: Path) -> None:
    """4 ranks as 2 hosts of 2: HSDP trains exactly as DDP does; ScapeFSDP's counters equal its formula."""
    cmd = [sys.executable, "-m", "benchmarks.network.run", "--loopback", "--model", "tiny", "--steps", "4"]
    cmd += ["--warmup", "2", "--batch-size", "2", "--block-size", "32", "--chunk-size", "256", "--max-bytes", "200000"]
    cmd += ["--world-size", "4", "--ranks-per-host", "2", "--methods", "ddp_adamw,hsdp_adamw,scape_fsdp_d0.01"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["ranks_per_host"] == 2
    per = results["profiles"][0]["summary"]["per_method"]
    ddp, hsdp, scape = per["ddp_adamw"], per["hsdp_adamw"], per["scape_fsdp_d0.01"]
    # HSDP is data parallelism over the 4 ranks: the same losses as DDP's, step by step (fp32 summation order).
    assert ddp["loss_curve"] == pytest.approx(hsdp["loss_curve"], rel=1e-5)
    assert math.isnan(hsdp["sent_bytes_counters"])  # FSDP's collectives are not the package's to count
    # SCAPE across the 2 hosts on each rank's shard (R = 2): the sparse steps send exactly the formula.
    assert scape["sent_bytes_counters"] == scape["formula_bytes"] > 0
    assert scape["formula_bytes"] < hsdp["formula_bytes"] / 10


def _assert_shaped(net: EmulatedNetwork) -> None:
    """Every host's link is shaped at 100 Mbit/s both ways, and TCP traffic from the first host to the second
    passes through its send-side shaper and the other's receive-side one. (The goodput it reaches depends on the
    machine's load; the kernel's shaper is what keeps it at or below the rate.)"""
    rate = parse_profile("100mbit").rate_bytes_per_s
    before = net.qdisc_stats()
    assert all(row["send_rate"] == row["recv_rate"] == rate for row in before), before
    bps = measure_throughput(net, seconds=0.5)
    after = net.qdisc_stats()
    assert bps is not None and bps > 0
    # The sender sends 1 MiB buffers until its time is up, at least one, and the receiver reads them all.
    assert after[0]["send_bytes"] - before[0]["send_bytes"] > 2**20, (before, after)
    assert after[1]["recv_bytes"] - before[1]["recv_bytes"] > 2**20, (before, after)


def test_emulated_network_is_shaped_and_removed() -> None:
    """Two hosts at 100 Mbit/s: shaped both ways, traffic through the shapers; afterwards no namespace or link of
    ours remains."""
    no_netns = _namespaces_work()  # here, not at import: collecting the fast lane creates no namespace
    if no_netns is not None:
        pytest.skip(f"no network namespaces: {no_netns}")
    tag = str(os.getpid())
    with EmulatedNetwork(2, parse_profile("100mbit")) as net:
        assert [h.address for h in net.hosts] == ["10.213.0.1", "10.213.0.2"]
        assert sorted(n for n in list_netns() if n.startswith(f"lsbench{tag}-")) == [
            f"lsbench{tag}-{r}" for r in (0, 1)
        ]
        _assert_shaped(net)
    assert not [n for n in list_netns() if n.startswith(f"lsbench{tag}-")]
    assert not [n for n in list_links() if n.startswith(f"lsb{tag}")]
    # Two ranks per host: one namespace and address per host, the goodput measured between hosts.
    with EmulatedNetwork(4, parse_profile("100mbit"), ranks_per_host=2) as net:
        assert [(h.address, h.node, h.local_rank) for h in net.hosts] == [
            ("10.213.0.1", 0, 0),
            ("10.213.0.1", 0, 1),
            ("10.213.0.2", 1, 0),
            ("10.213.0.2", 1, 1),
        ]
        assert len({h.netns for h in net.hosts}) == 2 and len(net.qdisc_stats()) == 2
        _assert_shaped(net)
    assert not [n for n in list_netns() if n.startswith(f"lsbench{tag}-")]
