"""SCAPE's dense sharded step against DDP's on the wire: one all-reduce against an all-to-all then an all-gather.

    sudo .venv/bin/python -m benchmarks.network.collective_pairs --profile 100mbit [--queue-seconds 0.5]

Two gloo processes in network namespaces behind the time-to-loss mode's shaped link (``netns.py``) time, on
tensors of the small model's padded size (3.47 MB fp32): DDP's all-reduce, the all-to-all that stands for
sharded SCAPE's reduce-scatter, its parameter all-gather, and the two back to back, as SCAPE's dense step runs
them, blocking and async, each after a short and after a 0.6 s idle. Medians and minima of 8 repetitions, and
what TCP did meanwhile in rank 0's namespace (``/proc/net/snmp`` and ``/proc/net/netstat``, per repetition):
segments retransmitted, retransmission timeouts, tail-loss probes. ``--sysctl KEY=VALUE`` sets a TCP setting in
both namespaces first (``net.ipv4.tcp_slow_start_after_idle=0``, ``net.ipv4.tcp_congestion_control=reno``, ...).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

NUMEL = 868352  # the small model's padded numel at W = 2 (lightning_scape.examples.workloads, preset "small")
# (file, section, counter) of what TCP did: retransmitted segments, RTO expiries, tail-loss probes.
TCP_COUNTERS = (
    ("/proc/net/snmp", "Tcp", "RetransSegs"),
    ("/proc/net/netstat", "TcpExt", "TCPTimeouts"),
    ("/proc/net/netstat", "TcpExt", "TCPLossProbes"),
)


def tcp_counters() -> list[int]:
    """This network namespace's :data:`TCP_COUNTERS` now."""
    values = []
    for path, section, name in TCP_COUNTERS:
        with open(path) as fh:
            lines = [line.split() for line in fh if line.startswith(section + ":")]
        header, row = lines[0], lines[1]
        values.append(int(row[header.index(name)]))
    return values


def worker() -> None:
    """One rank: time every collective pattern; rank 0 prints."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    grad, received = torch.randn(NUMEL), torch.empty(NUMEL)
    shard, params = torch.empty(NUMEL // world), torch.empty(NUMEL)

    def all_reduce() -> None:
        dist.all_reduce(grad)

    def all_to_all() -> None:
        dist.all_to_all_single(received, grad)

    def all_gather() -> None:
        dist.all_gather_into_tensor(params, shard)

    def pair() -> None:
        all_to_all()
        all_gather()

    def pair_async() -> None:
        w = dist.all_to_all_single(received, grad, async_op=True)
        assert w is not None
        w.wait()
        w = dist.all_gather_into_tensor(params, shard, async_op=True)
        assert w is not None
        w.wait()

    def pair_chunked(chunks: int) -> None:
        # The pair over `chunks` slices of the same bytes, every slice's collective launched before any is waited
        # on (where the slices land does not matter to the wire).
        n = NUMEL // world // chunks
        sends = [torch.empty(world * n) for _ in range(chunks)]
        recvs = [torch.empty(world * n) for _ in range(chunks)]
        for w in [dist.all_to_all_single(r, g, async_op=True) for r, g in zip(recvs, sends, strict=True)]:
            assert w is not None
            w.wait()
        works = [dist.all_gather_into_tensor(r, g[:n], async_op=True) for r, g in zip(recvs, sends, strict=True)]
        for w in works:
            assert w is not None
            w.wait()

    patterns: list[tuple[str, Callable[[], None]]] = [
        ("all-reduce (DDP)", all_reduce),
        ("all-to-all", all_to_all),
        ("all-gather", all_gather),
        ("all-to-all, all-gather", pair),
        ("same, async + wait", pair_async),
        # Which pairs are slow: the same collective twice, and the pair in the other order.
        ("all-reduce twice", lambda: (all_reduce(), all_reduce())),
        ("all-to-all twice", lambda: (all_to_all(), all_to_all())),
        ("all-gather twice", lambda: (all_gather(), all_gather())),
        ("all-gather, all-to-all", lambda: (all_gather(), all_to_all())),
        ("pair in 4 slices, async", lambda: pair_chunked(4)),
        ("pair in 16 slices, async", lambda: pair_chunked(16)),
    ]
    for idle in (0.0, 0.6):
        for name, fn in patterns:
            times, tcp = [], [0] * len(TCP_COUNTERS)
            for _ in range(8):
                dist.barrier()
                time.sleep(idle)
                dist.barrier()
                before = tcp_counters()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
                tcp = [t + b - a for t, a, b in zip(tcp, before, tcp_counters(), strict=True)]
            if rank == 0:
                med, low = 1e3 * statistics.median(times), 1e3 * min(times)
                per = "  ".join(f"{c[2]} {v / 8:5.1f}" for c, v in zip(TCP_COUNTERS, tcp, strict=True))
                print(f"idle {idle:.1f} s  {name:24s} median {med:6.1f} ms  min {low:6.1f} ms  {per}", flush=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Set up two shaped hosts and run :func:`worker` on each."""
    import benchmarks.network.netns as netns

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="100mbit", help="a profile of netns.PROFILES or a rate")
    ap.add_argument("--queue-seconds", type=float, default=netns._QUEUE_SECONDS, help="the shaper's queue length")
    ap.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE", help="a TCP setting for both hosts")
    args = ap.parse_args(argv)
    reason = netns.netns_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"needs network namespaces ({reason}): run as root on Linux.")
    netns._QUEUE_SECONDS = args.queue_seconds
    with netns.EmulatedNetwork(2, netns.parse_profile(args.profile)) as net:
        for h in net.hosts:
            for setting in args.sysctl:
                subprocess.run([*h.command_prefix(), "sysctl", "-q", "-w", setting], check=True)
        procs = []
        for h in net.hosts:
            env = {
                **os.environ,
                "MASTER_ADDR": net.master_addr,
                "MASTER_PORT": "29511",
                "WORLD_SIZE": "2",
                "RANK": str(h.rank),
                "GLOO_SOCKET_IFNAME": h.ifname,
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
            }
            cmd = [*h.command_prefix(), sys.executable, "-m", "benchmarks.network.collective_pairs", "--worker"]
            procs.append(subprocess.Popen(cmd, env=env, cwd=netns.REPO_ROOT))  # as a module, from the root
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
