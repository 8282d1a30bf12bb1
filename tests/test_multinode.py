"""The multi-node launches of ``docs/lightning.md`` and ``docs/litgpt.md``, run across two emulated nodes.

Each node is a network namespace of its own with one address, joined to the other by a bridge (the network
benchmark's :class:`~benchmarks.network.netns.EmulatedNetwork`); on each, ``torchrun --nnodes 2
--nproc-per-node 1 --node-rank R --master-addr <node 0>`` starts the user's command, exactly as on two
machines. The traffic between the nodes is read from the nodes' interface counters.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import child_env

from benchmarks.network.netns import EmulatedNetwork, Host, netns_unavailable_reason, parse_profile
from lightning_scape.examples.workloads import free_port

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(netns_unavailable_reason() is not None, reason=str(netns_unavailable_reason())),
]


def _tx_bytes(host: Host) -> int:
    out = subprocess.run(
        [*host.command_prefix(), "cat", f"/sys/class/net/{host.ifname}/statistics/tx_bytes"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout)


def _launch_on_two_nodes(net: EmulatedNetwork, command: list[str], timeout_s: float = 300) -> list[str]:
    """Run ``torchrun ... command`` on both nodes at once; returns each node's output, raising if one failed."""
    port = free_port()
    procs = []
    for host in net.hosts:
        torchrun = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={host.rank}",
            f"--master-addr={net.master_addr}",
            f"--master-port={port}",
        ]
        env = child_env(GLOO_SOCKET_IFNAME=host.ifname)
        procs.append(
            subprocess.Popen(
                [*host.command_prefix(), *torchrun, *command],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-5000:]
    return outputs


@pytest.fixture
def two_nodes():
    with EmulatedNetwork(world_size=2, profile=parse_profile("1gbit")) as net:
        yield net


def test_trainer_across_two_nodes_with_torchrun(two_nodes: EmulatedNetwork, tmp_path: Path) -> None:
    before = [_tx_bytes(h) for h in two_nodes.hosts]
    _launch_on_two_nodes(two_nodes, [str(REPO / "tests" / "_multinode_trainer.py"), str(tmp_path)])
    sent_on_the_wire = [_tx_bytes(h) - b for h, b in zip(two_nodes.hosts, before, strict=True)]
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["node_rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert torch.equal(results[0]["params"], results[1]["params"])  # the two nodes' replicas agree bitwise
    assert all(r["sparse_steps"] == 36 for r in results)
    # SCAPE's own count, and what really crossed between the nodes: at least the package's bytes, and far
    # less than DDP's all-reduce of the same 40 steps would have needed.
    for r, wire in zip(results, sent_on_the_wire, strict=True):
        assert 0 < r["sent"] < r["dense_equivalent"] / 4
        assert r["sent"] <= wire


def test_pretrain_debug_recipe_across_two_nodes_with_torchrun(two_nodes: EmulatedNetwork, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for i in range(12):
        (data / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 97}" for j in range(3000)))
    out_dir = tmp_path / "run"
    command = [
        "-m",
        "lightning_scape",
        "pretrain",
        "--config",
        "debug",
        "--devices",
        "1",
        "--num_nodes",
        "2",
        "--data",
        str(data),
        "--train.max_tokens",
        str(16 * 128 * 30),  # 30 steps of the recipe's global batch
        "--scape.dense_warmup_steps",
        "5",
        "--scape.density_ramp_steps",
        "0",
        "--out_dir",
        str(out_dir),
    ]
    outputs = _launch_on_two_nodes(two_nodes, command)
    summary = outputs[0]
    assert "(2 processes)" in summary, summary[-3000:]
    # After the warm-up every step sends about 1/80 of what DDP's all-reduce of the same model would.
    last_step = re.search(r"in the last step, ([\d.]+)x fewer\)", summary)
    assert last_step is not None and float(last_step.group(1)) > 50, summary[-3000:]
    assert (out_dir / "final" / "lit_model.pth").is_file()
    assert len(list((out_dir / "final" / "lit_model.pth.scape").glob("*rank-*.pt"))) == 2  # one per node
