"""What both network benchmarks run on: the profiles and the network they get, the workers' launch, the
loop over profiles, and the records a finished run is rebuilt from.

``benchmarks.network.run`` (step times) and ``benchmarks.network.time_to_loss`` (time to a loss) differ in
the workers' spec, the summary of their records and the outputs; the rest is here. Per profile, the workers'
specs, logs and raw records (``rank<r>.json``) go to ``<out>/<profile>/`` (``loopback`` without emulation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.network.netns import (
    PROFILES,
    REPO_ROOT,
    EmulatedNetwork,
    Host,
    LoopbackNetwork,
    Network,
    Profile,
    cleanup_stale,
    measure_throughput,
    netns_unavailable_reason,
    parse_profile,
    signals_raise,
)
from benchmarks.network.worker import WorkerSpec
from lightning_scape.examples.workloads import free_port


def command_line(module: str, argv: list[str] | None) -> str:
    """The command as ``results.md`` shows it: ``python -m <module>`` and the arguments (``sys.argv``'s
    when ``argv`` is None)."""
    return f"python -m {module} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))


def select_profiles(spec: str, latency_ms: float = 0.0) -> list[Profile]:
    """``--profile``: a comma list of profile names or rates, or ``all`` (every one of ``PROFILES``)."""
    names = list(PROFILES) if spec == "all" else [p for p in spec.split(",") if p]
    return [parse_profile(n, latency_ms) for n in names]


def emulation(loopback: bool, profiles: list[Profile]) -> tuple[list[Profile], str | None]:
    """The profiles to run and why there is no emulation (None: there is; leftovers of earlier runs removed).

    Without emulation (``--loopback``, or no root or tools) the run is one ``unlimited`` profile on loopback,
    and a warning says so.
    """
    reason = "--loopback given" if loopback else netns_unavailable_reason()
    if reason is not None:
        print(f"WARNING: no network emulation ({reason}); running on loopback WITHOUT any rate limit.", flush=True)
        return [parse_profile("unlimited")], reason
    stale = cleanup_stale()
    if stale:
        print(f"removed leftovers of earlier runs: {' '.join(stale)}")
    return profiles, None


def machine_description() -> dict[str, Any]:
    """CPU, cores, memory, kernel, Python and torch versions, load average."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = math.nan
    try:
        with open("/proc/meminfo") as fh:
            mem_gib = int(fh.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": os.getloadavg(),
    }


def results_header(module: str, argv: list[str] | None, args: argparse.Namespace, reason: str | None) -> dict[str, Any]:
    """The first entries of ``results.json``: the network, the command, the machine and the workload."""
    return {
        "emulated": reason is None,
        "loopback_reason": reason,
        "command": command_line(module, argv),
        "machine": machine_description(),
        "model": args.model,
        "world_size": args.world_size,
        "ranks_per_host": getattr(args, "ranks_per_host", 1),
        "batch_size": args.batch_size,
        "block_size": args.block_size,
        "steps": args.steps,
    }


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the runner dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL after 5 s, each worker this run started (by its own process group id)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def read_ranks(prof_dir: str, world_size: int) -> list[dict[str, Any]]:
    """The workers' records of one profile (``rank<r>.json``), by rank."""
    ranks = []
    for r in range(world_size):
        with open(os.path.join(prof_dir, f"rank{r}.json")) as fh:
            ranks.append(json.load(fh))
    return ranks


def launch_workers(
    net: Network, spec_for: Callable[[Host], WorkerSpec], prof_dir: str, timeout_s: float
) -> dict[str, Any]:
    """Start one worker per host of ``net`` (set up) with ``spec_for(host)``, wait, return their records.

    Args:
        net: The network, set up.
        spec_for: The worker spec of a host (``out_dir`` must be ``prof_dir``).
        prof_dir: Where the specs, logs and the workers' ``rank<r>.json`` go.
        timeout_s: Give up (and stop the workers) after this many seconds.

    Returns:
        ``ranks`` (the workers' records, by rank) and ``qdisc`` (the shapers' counters).

    Raises:
        RuntimeError: A worker failed (the message holds the tail of every rank's log).
        TimeoutError: The workers ran longer than ``timeout_s``.
    """
    os.makedirs(prof_dir, exist_ok=True)
    port = 29500 if net.emulated else free_port()
    world_size = len(net.hosts)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[str] = []
    try:
        for h in net.hosts:
            spec = spec_for(h)
            spec_path = os.path.join(prof_dir, f"spec_rank{h.rank}.json")
            with open(spec_path, "w") as fh:
                json.dump(asdict(spec), fh, indent=1)
            env = {
                **os.environ,
                "MASTER_ADDR": net.master_addr,
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(world_size),
                "RANK": str(h.rank),
                "NODE_RANK": str(h.node),
                "GROUP_RANK": str(h.node),
                "LOCAL_RANK": str(h.local_rank),
                "LOCAL_WORLD_SIZE": str(world_size // len({x.node for x in net.hosts})),
                "PYTHONFAULTHANDLER": "1",  # a worker that aborts leaves every thread's stack in its log
                # gloo must use the host's own interface (in a namespace the hostname resolves to nothing).
                "GLOO_SOCKET_IFNAME": h.ifname,
                "OMP_NUM_THREADS": "1",
            }
            log = os.path.join(prof_dir, f"rank{h.rank}.log")
            logs.append(log)
            with open(log, "wb") as lf:
                # Run as a module from the repository's root, which puts ``benchmarks`` on the worker's path.
                cmd = [*h.command_prefix(), sys.executable, "-m", "benchmarks.network.worker", spec_path]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        cwd=REPO_ROOT,
                        stdout=None if h.rank == 0 else lf,
                        stderr=lf,
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                )
        deadline = time.time() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                detail = "\n".join(f"--- rank {r} ({logs[r]}):\n{_tail(logs[r])}" for r in range(len(procs)))
                raise RuntimeError(f"worker rank(s) {failed} failed with exit codes {codes}.\n{detail}")
            if all(c == 0 for c in codes):
                break
            if time.time() > deadline:
                raise TimeoutError(
                    f"workers still running after --timeout-s {timeout_s:.0f} s; raise it, or lower "
                    f"--steps (logs: {prof_dir})."
                )
            time.sleep(0.2)
    finally:
        _stop(procs)
    return {"ranks": read_ranks(prof_dir, len(net.hosts)), "qdisc": net.qdisc_stats()}


def measure_profiles(
    results: dict[str, Any],
    profiles: list[Profile],
    out: str,
    *,
    announce: str,
    spec_for: Callable[[Host, str], WorkerSpec],
    timeout_s: float,
    summarize: Callable[[list[dict[str, Any]]], dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
    write: Callable[[dict[str, Any]], None],
    rate_changes: Sequence[tuple[float, float]] = (),
) -> None:
    """Run the workers on every profile in turn and append each profile's entry to ``results["profiles"]``.

    Per profile: set up its network (loopback when ``results["emulated"]`` is False), measure the goodput,
    launch the workers, summarize their records, print, and write every output, so that an interrupted
    multi-profile run keeps what it measured.

    Args:
        results: The run's ``results.json`` so far (:func:`results_header` and the benchmark's own entries).
        profiles: From :func:`emulation`.
        out: The run's folder; each profile's records go to ``<out>/<profile>/``.
        announce: What the line that starts a profile says after ``== <profile>: ``.
        spec_for: The worker spec of a host, given the profile's folder.
        timeout_s: Give up on a profile after this many seconds.
        summarize: The profile's summary from the workers' records (by rank).
        show: Prints the profile's tables, given its entry (and may add to it).
        write: Writes every output of ``results``.
        rate_changes: ``(seconds, Mbit/s)``: after that many seconds of the workers' run the link changes to that
            rate (a link whose capacity changes during training; emulated profiles only).
    """
    emulated, world_size = results["emulated"], results["world_size"]
    per_host = results.get("ranks_per_host", 1)
    with signals_raise():
        for prof in profiles:
            label = prof.name if emulated else "loopback"
            prof_dir = os.path.join(out, label)
            net: Network = (
                EmulatedNetwork(world_size, prof, ranks_per_host=per_host)
                if emulated
                else LoopbackNetwork(world_size, results["loopback_reason"], ranks_per_host=per_host)
            )
            print(f"== {label}: {announce}", flush=True)
            t0 = time.time()
            with net:
                tput = measure_throughput(net)
                if tput:
                    print(f"   measured TCP goodput host 0 -> 1: {tput / 1e6:.0f} Mbit/s", flush=True)

                def host_spec(h: Host, prof_dir: str = prof_dir) -> WorkerSpec:
                    return spec_for(h, prof_dir)

                timers = [
                    threading.Timer(t, net.set_rate, args=(mbit,))
                    for t, mbit in rate_changes
                    if isinstance(net, EmulatedNetwork)
                ]
                for timer in timers:
                    timer.daemon = True
                    timer.start()
                try:
                    raw = launch_workers(net, host_spec, prof_dir, timeout_s)
                finally:
                    for timer in timers:
                        timer.cancel()
            summary = summarize(raw["ranks"])
            summary["qdisc"] = raw["qdisc"]
            results["params"] = raw["ranks"][0]["params"]
            entry = {
                "profile": label,
                "rate_mbit": prof.rate_mbit,
                "latency_ms": prof.latency_ms,
                "throughput_bps": tput,
                "rate_changes": [list(c) for c in rate_changes],
                "wall_s": time.time() - t0,
                "summary": summary,
            }
            results["profiles"].append(entry)
            show(entry)
            print(f"   ({time.time() - t0:.0f} s)", flush=True)
            results["machine"]["loadavg_end"] = os.getloadavg()
            write(results)


def resummarize(
    out: str, summarize: Callable[[list[dict[str, Any]], dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """``<out>/results.json`` with every profile's summary rebuilt from its records (after a change to the
    statistics); the shapers' counters, which are not in the records, are kept.

    Args:
        out: A finished run's folder.
        summarize: A profile's summary from the workers' records (by rank) and the run's ``results.json``.

    Returns:
        The run's results with the new summaries (nothing is written).
    """
    with open(os.path.join(out, "results.json")) as fh:
        results: dict[str, Any] = json.load(fh)
    for prof in results["profiles"]:
        ranks = read_ranks(os.path.join(out, prof["profile"]), results["world_size"])
        qdisc = prof["summary"].get("qdisc")
        prof["summary"] = summarize(ranks, results)
        prof["summary"]["qdisc"] = qdisc
    return results
