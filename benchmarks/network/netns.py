"""Emulated hosts on one machine: one network namespace per rank, veth pairs, a bridge and ``tc`` limits.

Rank r lives in namespace ``lsbench<pid>-<r>`` with interface ``lsb<pid>n<r>`` (address ``10.213.0.<r+1>``);
the other end of its veth pair, ``lsb<pid>h<r>``, is a port of the bridge ``lsb<pid>b`` in the root
namespace, which carries no address, so nothing outside the namespaces is reachable from them.

Shaping models a full-duplex NIC of the profile's rate: a token bucket (``tbf``) on the rank's egress
(what it sends) and another on the bridge port's egress (what it receives). An optional one-way latency
is a ``netem`` delay in front of the send-side bucket, so a round trip between two hosts takes twice it.

Everything made is recorded as it is made and removed in reverse order by :meth:`EmulatedNetwork.teardown`,
which ``__exit__``, ``atexit`` and the signal handlers of :func:`signals_raise` all reach. A run that was
killed with SIGKILL leaves its namespaces behind; :func:`cleanup_stale` (called on every start) removes
those whose creating process is gone.

Also a command line, for the throughput probe and for manual cleanup::

    python -m benchmarks.network.netns cleanup          # remove every lsbench namespace and lsb link
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

NETNS_PREFIX = "lsbench"
LINK_PREFIX = "lsb"
SUBNET = "10.213.0"
_NETNS_RE = re.compile(rf"^{NETNS_PREFIX}(\d+)-\d+$")
_LINK_RE = re.compile(rf"^{LINK_PREFIX}(\d+)[bhn]\d*$")
# Linux interface names hold at most 15 characters: "lsb" + a 7-digit pid + "h" + 2 digits = 13.
_IFNAMSIZ = 15
# A Linux GSO super-packet is up to 64 KiB; a bucket smaller than that makes tbf split every such packet.
_MIN_BURST_BYTES = 64 * 1024
# Bucket depth: 1 ms of traffic at the profile's rate (1.25 MB at 10 Gbit/s, 125 kB at 1 Gbit/s), floored
# at one GSO packet. Deeper buckets let small messages (SCAPE's 245 kB step at d = 0.01) pass at line rate
# and would flatter the sparse methods.
_BURST_SECONDS = 0.001
# Queue: 50 ms of traffic (6.25 MB at 1 Gbit/s), enough that TCP never overflows it on these links.
_QUEUE_SECONDS = 0.050
_MIN_QUEUE_BYTES = 256 * 1024
# The repository's root: commands started there as ``python -m benchmarks...`` find the benchmarks.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Profile:
    """A network profile.

    Args:
        name: Label used in every output.
        rate_mbit: Rate of each host's link in Mbit/s, per direction; None: no limit (loopback).
        latency_ms: One-way delay added to every packet a host sends (round trip: twice this).
    """

    name: str
    rate_mbit: float | None
    latency_ms: float = 0.0

    @property
    def rate_bytes_per_s(self) -> float | None:
        """The rate in bytes per second (None: unlimited)."""
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8


PROFILES: dict[str, Profile] = {
    "10gbit": Profile("10gbit", 10_000.0),
    "1gbit": Profile("1gbit", 1_000.0),
    "100mbit": Profile("100mbit", 100.0),
}


def parse_profile(name: str, latency_ms: float = 0.0) -> Profile:
    """A profile by name: one of :data:`PROFILES`, ``<n>mbit``/``<n>gbit``, or ``unlimited``.

    Args:
        name: The profile's name.
        latency_ms: One-way latency to add.

    Returns:
        The profile.

    Raises:
        ValueError: The name is not a known profile or rate.
    """
    key = name.strip().lower()
    if key in PROFILES:
        p = PROFILES[key]
        return Profile(p.name, p.rate_mbit, latency_ms)
    if key == "unlimited":
        return Profile("unlimited", None, latency_ms)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(mbit|gbit)", key)
    if not m:
        raise ValueError(
            f"unknown network profile {name!r}: use one of {[*PROFILES, 'unlimited']} or a rate such as "
            "'250mbit' or '2.5gbit'."
        )
    rate = float(m.group(1)) * (1000.0 if m.group(2) == "gbit" else 1.0)
    return Profile(key, rate, latency_ms)


@dataclass(frozen=True)
class Host:
    """Where one rank runs.

    Args:
        rank: The rank.
        netns: Its network namespace (None: the root namespace, loopback mode).
        ifname: The interface its traffic leaves through (inside ``netns``).
        address: Its IPv4 address.
        node: The emulated host it runs on (ranks of one node share its namespace, address and link).
        local_rank: Its index among the ranks of its node.
    """

    rank: int
    netns: str | None
    ifname: str
    address: str
    node: int = 0
    local_rank: int = 0

    def command_prefix(self) -> list[str]:
        """What to put in front of a command so that it runs on this host."""
        return [] if self.netns is None else ["ip", "netns", "exec", self.netns]


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None if they can.

    Returns:
        A sentence naming what is missing and how to get it, or None.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (network namespaces, veth pairs and tc need root; rerun with sudo)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2)"
    return None


def _run(cmd: list[str], check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command, raising an error that shows it and its stderr when it fails."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=cwd)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}\n"
            "Network emulation needs root, the iproute2 tools and kernel support for veth, bridge, tbf "
            "and netem; run with --loopback to benchmark without it."
        )
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_netns() -> list[str]:
    """Names of the named network namespaces."""
    out = _run(["ip", "-j", "netns", "list"], check=False).stdout.strip()
    if not out:
        return []
    return [str(e["name"]) for e in json.loads(out)]


def list_links() -> list[str]:
    """Names of the links of the root namespace."""
    out = _run(["ip", "-j", "link", "show"], check=False).stdout.strip()
    if not out:
        return []
    return [str(e["ifname"]) for e in json.loads(out)]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL the processes still inside ``ns`` (only ever ones this harness started there)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for p in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(p), signal.SIGKILL)


def cleanup_stale(all_of_ours: bool = False) -> list[str]:
    """Remove namespaces and links this harness left behind.

    Args:
        all_of_ours: Remove every ``lsbench*`` namespace and ``lsb<digits>`` link, also those of a run that
            is still alive; by default only those whose creating process (the pid in the name) is gone.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    for link in list_links():
        m = _LINK_RE.match(link)
        if m and (all_of_ours or not _pid_alive(int(m.group(1)))):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    for ns in list_netns():
        m = _NETNS_RE.match(ns)
        if m and (all_of_ours or not _pid_alive(int(m.group(1)))):
            _kill_netns_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    return removed


@dataclass
class EmulatedNetwork:
    """W ranks on W / P hosts, one namespace each, on a shaped bridge (a context manager: set up on enter,
    removed on exit).

    The P ranks of a host share its namespace, address and link: traffic between them stays on the
    namespace's loopback, unshaped (a node's fast interconnect), and only traffic between hosts crosses the
    shaped link.

    Args:
        world_size: Number of ranks.
        profile: Rate and latency of every host's link.
        mtu: MTU of the veth links (1500: plain Ethernet).
        ranks_per_host: P, the ranks that share one host (a divisor of ``world_size``).
    """

    world_size: int
    profile: Profile
    mtu: int = 1500
    ranks_per_host: int = 1
    hosts: list[Host] = field(default_factory=list)
    _made: list[tuple[str, str]] = field(default_factory=list)
    _tag: str = field(default_factory=lambda: str(os.getpid()))

    @property
    def emulated(self) -> bool:
        """Namespaces and shaping are in place (False: loopback)."""
        return True

    @property
    def master_addr(self) -> str:
        """Address of rank 0 (the rendezvous)."""
        return self.hosts[0].address

    def __enter__(self) -> EmulatedNetwork:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        """Create the namespaces, bridge, veth pairs, addresses and qdiscs.

        Raises:
            RuntimeError: A command failed (everything made so far is removed first).
        """
        if not 1 <= self.world_size <= 250:
            raise ValueError(f"world_size={self.world_size} must lie in [1, 250] (one /24 subnet).")
        reason = netns_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"cannot emulate a network: {reason}.")
        atexit.register(self.teardown)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise

    def _setup(self) -> None:
        if self.ranks_per_host < 1 or self.world_size % self.ranks_per_host:
            raise ValueError(f"ranks_per_host={self.ranks_per_host} must divide world_size={self.world_size}.")
        tag = self._tag
        bridge = f"{LINK_PREFIX}{tag}b"
        if len(bridge) + 2 > _IFNAMSIZ:
            raise RuntimeError(f"pid {tag} is too long for interface names of {_IFNAMSIZ} characters.")
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        self._made.append(("link", bridge))
        _run(["ip", "link", "set", bridge, "up"])
        for r in range(self.world_size // self.ranks_per_host):
            ns, outer, inner = f"{NETNS_PREFIX}{tag}-{r}", f"{LINK_PREFIX}{tag}h{r}", f"{LINK_PREFIX}{tag}n{r}"
            addr = f"{SUBNET}.{r + 1}"
            _run(["ip", "netns", "add", ns])
            self._made.append(("netns", ns))
            _run(["ip", "link", "add", outer, "mtu", str(self.mtu), "type", "veth", "peer", "name", inner])
            self._made.append(("link", outer))
            _run(["ip", "link", "set", inner, "netns", ns])
            _run(["ip", "link", "set", outer, "master", bridge])
            _run(["ip", "link", "set", outer, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", inner])
            _run(["ip", "-n", ns, "link", "set", inner, "up"])
            self._shape(ns, inner, outer)
            for local in range(self.ranks_per_host):
                self.hosts.append(Host(r * self.ranks_per_host + local, ns, inner, addr, node=r, local_rank=local))

    def _tbf_args(self) -> list[str]:
        rate = self.profile.rate_bytes_per_s
        assert rate is not None
        burst = max(_MIN_BURST_BYTES, int(rate * _BURST_SECONDS))
        limit = max(_MIN_QUEUE_BYTES, int(rate * _QUEUE_SECONDS))
        return ["tbf", "rate", f"{self.profile.rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]

    def _shape(self, ns: str, inner: str, outer: str) -> None:
        p = self.profile
        if p.latency_ms > 0:
            probe = _run(["tc", "-n", ns, "qdisc", "add", "dev", inner, "root", "netem", "delay", "1ms"], check=False)
            if probe.returncode != 0:
                raise RuntimeError(
                    f"--latency-ms needs the netem qdisc (kernel module sch_netem), which this kernel lacks "
                    f"({probe.stderr.strip()}); run without --latency-ms, or on a kernel with netem."
                )
            _run(["tc", "-n", ns, "qdisc", "del", "dev", inner, "root"])
            # netem holds every packet for the delay: its queue must cover rate x delay (x2 for safety).
            rate = p.rate_bytes_per_s or 1.25e9
            packets = max(1000, int(2 * rate * p.latency_ms / 1000 / self.mtu))
            delay = ["netem", "delay", f"{p.latency_ms}ms", "limit", str(packets)]
            _run(["tc", "-n", ns, "qdisc", "add", "dev", inner, "root", "handle", "1:", *delay])
            if p.rate_mbit is not None:
                _run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", inner, "parent", "1:1", "handle", "10:", *self._tbf_args()]
                )
        elif p.rate_mbit is not None:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", inner, "root", *self._tbf_args()])
        if p.rate_mbit is not None:
            _run(["tc", "qdisc", "add", "dev", outer, "root", *self._tbf_args()])

    def set_rate(self, rate_mbit: float) -> None:
        """Change every host's link to ``rate_mbit`` while the workers run (a link whose capacity changes)."""
        if self.profile.latency_ms > 0 or self.profile.rate_mbit is None:
            raise ValueError("a link change needs a rate-limited profile without --latency-ms")
        self.profile = dataclasses.replace(self.profile, rate_mbit=rate_mbit)
        for r in range(self.world_size // self.ranks_per_host):
            tag = self._tag
            ns, outer, inner = f"{NETNS_PREFIX}{tag}-{r}", f"{LINK_PREFIX}{tag}h{r}", f"{LINK_PREFIX}{tag}n{r}"
            _run(["tc", "-n", ns, "qdisc", "change", "dev", inner, "root", *self._tbf_args()])
            _run(["tc", "qdisc", "change", "dev", outer, "root", *self._tbf_args()])

    def qdisc_stats(self) -> list[dict[str, int]]:
        """Per host: bytes and drops of its send-side and receive-side shapers so far, and the rate each is set to
        (bytes per second, as ``tc`` reports it)."""
        out: list[dict[str, int]] = []
        for h in self.hosts:
            if h.local_rank:
                continue
            assert h.netns is not None
            row: dict[str, int] = {}
            outer = f"{LINK_PREFIX}{self._tag}h{h.node}"
            for side, cmd in (
                ("send", ["tc", "-n", h.netns, "-j", "-s", "qdisc", "show", "dev", h.ifname]),
                ("recv", ["tc", "-j", "-s", "qdisc", "show", "dev", outer]),
            ):
                text = _run(cmd, check=False).stdout.strip()
                for q in json.loads(text) if text else []:
                    if q.get("kind") == "tbf":
                        row[f"{side}_bytes"] = int(q.get("bytes", 0))
                        row[f"{side}_drops"] = int(q.get("drops", 0))
                        row[f"{side}_rate"] = int(q.get("options", {}).get("rate", 0))
            out.append(row)
        return out

    def teardown(self) -> None:
        """Remove everything :meth:`setup` made (idempotent; never raises)."""
        made, self._made = self._made, []
        for kind, name in reversed(made):
            if kind == "link":
                # Deleting one end of a veth pair deletes both.
                _run(["ip", "link", "del", name], check=False)
            else:
                _kill_netns_processes(name)
                _run(["ip", "netns", "del", name], check=False)
        self.hosts = []
        with contextlib.suppress(Exception):
            atexit.unregister(self.teardown)


@dataclass
class LoopbackNetwork:
    """All ranks on 127.0.0.1 in the root namespace, no limit (not root, or ``--loopback``).

    Args:
        world_size: Number of ranks.
        reason: Why the network is not emulated (shown in every output).
        ranks_per_host: The ranks counted as one host (they get its node rank).
    """

    world_size: int
    reason: str
    ranks_per_host: int = 1
    hosts: list[Host] = field(default_factory=list)
    profile: Profile = field(default_factory=lambda: Profile("loopback", None))

    @property
    def emulated(self) -> bool:
        """Namespaces and shaping are in place (False: loopback)."""
        return False

    @property
    def master_addr(self) -> str:
        """Address of rank 0 (the rendezvous)."""
        return "127.0.0.1"

    def __enter__(self) -> LoopbackNetwork:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        """Nothing to create: every rank is on ``lo``."""
        p = self.ranks_per_host
        self.hosts = [Host(r, None, "lo", "127.0.0.1", node=r // p, local_rank=r % p) for r in range(self.world_size)]

    def qdisc_stats(self) -> list[dict[str, int]]:
        """No shaper on loopback."""
        return [{} for h in self.hosts if h.local_rank == 0]

    def teardown(self) -> None:
        """Nothing to remove."""
        self.hosts = []


Network = EmulatedNetwork | LoopbackNetwork


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT into ``KeyboardInterrupt`` and SIGTERM, SIGHUP into ``SystemExit`` while inside.

    Python already raises on SIGINT unless the shell started it with SIGINT ignored (a background job),
    so it is set explicitly: every way of stopping a run goes through the ``finally`` blocks that remove
    the namespaces.
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def measure_throughput(net: Network, seconds: float = 1.0, port: int = 29400) -> float | None:
    """TCP goodput from rank 0 to rank 1 over the emulated link, in bits per second.

    Args:
        net: The network (set up).
        seconds: How long the sender sends.
        port: TCP port on rank 1.

    Returns:
        Bits per second received, or None for loopback or a single host.
    """
    src = net.hosts[0] if net.hosts else None
    others = [h for h in net.hosts if src is not None and h.node != src.node]
    if not net.emulated or src is None or not others:
        return None
    dst = others[0]
    me = [sys.executable, "-m", "benchmarks.network.netns"]
    server = subprocess.Popen(
        [*dst.command_prefix(), *me, "serve", dst.address, str(port), str(seconds + 10)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        for _ in range(100):  # the server needs a moment to listen
            send = [*src.command_prefix(), *me, "send", dst.address, str(port), str(seconds)]
            if _run(send, check=False, cwd=REPO_ROOT).returncode == 0:
                break
            time.sleep(0.1)
        out, _ = server.communicate(timeout=seconds + 20)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return float(out.strip()) if out.strip() else None


def _serve(addr: str, port: int, timeout_s: float) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1)
        s.settimeout(timeout_s)
        conn, _ = s.accept()
        with conn:
            n, t0 = 0, time.perf_counter()
            while chunk := conn.recv(1 << 20):
                n += len(chunk)
            print(n * 8 / (time.perf_counter() - t0))


def _send(addr: str, port: int, seconds: float) -> None:
    buf = b"\0" * (1 << 20)
    with socket.create_connection((addr, port), timeout=5) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(buf)


def main(argv: list[str] | None = None) -> None:
    """``cleanup`` (remove leftovers), or the probe's ``serve``/``send`` halves."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cleanup", help="remove lsbench namespaces and lsb links")
    c.add_argument("--all", action="store_true", help="also those of runs that are still alive")
    for name in ("serve", "send"):
        p = sub.add_parser(name)
        p.add_argument("addr")
        p.add_argument("port", type=int)
        p.add_argument("seconds", type=float)
    ns = ap.parse_args(argv)
    if ns.cmd == "cleanup":
        removed = cleanup_stale(all_of_ours=ns.all)
        print("removed:", " ".join(removed) if removed else "nothing")
    elif ns.cmd == "serve":
        _serve(ns.addr, ns.port, ns.seconds)
    else:
        _send(ns.addr, ns.port, ns.seconds)


if __name__ == "__main__":
    main()
