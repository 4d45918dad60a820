"""Emulated hosts on this machine: network namespaces joined by a bridge, each link shaped (``stratagem launch --hosts``).

Each host is a network namespace (and a UTS namespace: its own hostname, ``host0``, ``host1``, ...)
with one interface, ``eth0``, at ``10.77.0.<i+1>/24``. Every ``eth0`` is one end of a veth pair whose
other end is a port of a bridge that lives in a namespace of its own (the switch). Nothing is created
in this machine's own network namespace: the addresses exist only inside the namespaces made here, so
no traffic ever leaves them, and two sets of emulated hosts (two launches, two helpers) never meet.

A link is shaped in both directions by a token bucket (``tc qdisc ... tbf``) on each end's egress: the
host's ``eth0`` (what it sends) and its bridge port (what it receives). ``link`` sets every host's
rate, ``link_of`` one host's (a straggler's slower link). ``latency`` adds a one-way delay between
two hosts (``netem``, half on each end), where the kernel has ``netem``; where it does not, asking for
it is a ``ConfigurationError`` saying so.

Every namespace is held by a small process of ours (a *holder*) that made it with ``unshare`` and
waits; it dies with its parent (``PR_SET_PDEATHSIG``) or when :meth:`EmulatedHosts.close` closes its
stdin. The kernel removes a namespace when the last process in it is gone, so no namespace, veth or
bridge outlives the launcher, even one killed with SIGKILL (none is named in ``ip netns``). The
holders die with the *thread* that started them: start :class:`EmulatedHosts` from the thread that
lives as long as the hosts (the launcher's main thread).

:meth:`EmulatedHosts.set_link` changes one host's link while it runs (cut, slowed, restored: the fault
matrix's link faults, :mod:`stratagem.testing.faults`).

A command runs inside a host through :meth:`EmulatedHosts.command` (a prefix that enters the host's
namespaces with ``setns`` and execs it). Needs Linux, ``ip`` and ``tc`` (iproute2), and the right to
make namespaces: root, or an unprivileged user namespace (``unshare -r stratagem launch --hosts ...``).

    >>> parse_rate("1gbit"), parse_rate("100mbit"), format_rate(2_500_000_000)
    (1000000000, 100000000, '2.5gbit')
    >>> spec = HostsSpec.parse(4, link="1gbit", link_of=["host3=100mbit"])
    >>> [format_rate(spec.rate_of(i)) for i in range(4)], spec.address(3)
    (['1gbit', '1gbit', '1gbit', '100mbit'], '10.77.0.4')

    with EmulatedHosts(spec) as hosts:           # root (or unshare -r) on Linux
        subprocess.run(hosts.command(0, ["ping", "-c", "1", hosts.addresses[1]]))

    from stratagem.launch.launcher import launch   # a whole job on them: stratagem launch --hosts 4 ...
    launch(["python3", "train.py"], workers=4, hosts=HostsSpec.parse(4, link="1gbit"))

Tests use them through :mod:`stratagem.testing.hosts` (every process started in them reaped).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import select
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from stratagem.core.cluster import REPLICA_JOBS, ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError

#: The hosts' subnet (a /24): host i is SUBNET.<i+1>. It exists only inside the namespaces made here.
SUBNET = "10.77.0"
#: Hosts one emulated network may hold (the /24 less the network and broadcast addresses).
MAX_HOSTS = 254
#: The port of a host's first task; its next tasks take the ports after it. A host's namespace is
#: fresh, so nothing else listens there, and these ports sit below the kernel's ephemeral range.
BASE_PORT = 2222
#: Seconds a namespace command (``ip``, ``tc``) may take.
COMMAND_TIMEOUT = 30.0
#: The longest a packet may wait in a link's token bucket (its queue), in ms.
QUEUE_MS = 20

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUTS = 0x04000000

#: A holder: die with the parent (PR_SET_PDEATHSIG), make a network and a UTS namespace, name the host,
#: say "ready", then wait until the parent closes our stdin (or dies).
_HOLDER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(1, 9, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    f"if libc.unshare({_CLONE_NEWNET | _CLONE_NEWUTS}) != 0:\n"
    "    os.write(1, ('error ' + os.strerror(ctypes.get_errno()) + '\\n').encode())\n"
    "    os._exit(3)\n"
    "name = sys.argv[2].encode()\n"
    "libc.sethostname(name, len(name))\n"
    "os.write(1, b'ready\\n')\n"
    "while os.read(0, 4096):\n"
    "    pass\n"
)

#: Enter a holder's namespaces (its pid is argv[1]) and exec the command.
_ENTER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"for kind, flag in (('net', {_CLONE_NEWNET}), ('uts', {_CLONE_NEWUTS})):\n"
    "    fd = os.open('/proc/' + sys.argv[1] + '/ns/' + kind, os.O_RDONLY)\n"
    "    if libc.setns(fd, flag) != 0:\n"
    "        sys.exit('stratagem: cannot enter the emulated host: ' + os.strerror(ctypes.get_errno()))\n"
    "    os.close(fd)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*$", re.IGNORECASE)
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """Bits per second of a link rate as ``tc`` writes it: ``100mbit``, ``1gbit``, ``2.5gbit`` (SI units)."""
    match = _RATE.match(str(text))
    bits = float(match.group(1)) * _UNITS[match.group(2).lower()] if match else 0
    if bits < 8000:
        raise ConfigurationError(f"link rate {text!r}: give a rate in bits per second of at least 8kbit, "
                                 f"like 100mbit, 1gbit or 10gbit")
    return int(bits)


def format_rate(bits: int) -> str:
    """``1gbit`` for 10**9, ``2.5gbit``, ``100mbit``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _UNITS[unit]:
            return f"{bits / _UNITS[unit]:g}{unit}"
    return f"{bits}bit"


def parse_delay(text: str) -> float:
    """Seconds of a delay written ``5ms``, ``200us`` or ``0.1s``."""
    match = _DELAY.match(str(text))
    if not match or float(match.group(1)) <= 0:
        raise ConfigurationError(f"latency {text!r}: give a delay like 200us, 5ms or 0.1s")
    return float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match.group(2).lower()]


@dataclass(frozen=True)
class HostsSpec:
    """The emulated hosts of a job: how many, each one's link rate (bits/s; None: not shaped), the
    one-way latency between two hosts (seconds; None: none), and how tasks are placed on them
    (``tasks_per_host``: K tasks on each host in turn; None: round-robin)."""

    count: int
    link: int | None = None
    link_of: Mapping[int, int] = field(default_factory=dict)
    latency: float | None = None
    tasks_per_host: int | None = None

    @classmethod
    def parse(cls, count: int, link: str | None = None, link_of: Iterable[str] = (),
              latency: str | None = None, tasks_per_host: int | None = None) -> "HostsSpec":
        """The spec of ``--hosts N --link RATE --link-of HOST=RATE ... --latency D --tasks-per-host K``;
        a ``ConfigurationError`` names a bad value and the form it takes."""
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_HOSTS:
            raise ConfigurationError(f"--hosts must be a number of hosts from 1 to {MAX_HOSTS}, got {count!r}")
        if tasks_per_host is not None and (isinstance(tasks_per_host, bool) or not isinstance(tasks_per_host, int)
                                           or tasks_per_host < 1):
            raise ConfigurationError(f"--tasks-per-host must be an integer >= 1, got {tasks_per_host!r}")
        rates: dict[int, int] = {}
        for item in link_of:
            host, sep, rate = str(item).partition("=")
            index = _host_index(host.strip(), count) if sep else None
            if index is None:
                raise ConfigurationError(f"--link-of {item!r}: give HOST=RATE with HOST one of host0..host{count - 1} "
                                         f"(or its number), e.g. --link-of host{count - 1}=100mbit")
            rates[index] = parse_rate(rate)
        return cls(count, None if link is None else parse_rate(link), rates,
                   None if latency is None else parse_delay(latency), tasks_per_host)

    def rate_of(self, host: int) -> int | None:
        """Host ``host``'s link rate in bits/s (None: not shaped)."""
        return self.link_of.get(host, self.link)

    @staticmethod
    def name(host: int) -> str:
        """``host2``: host 2's name (its hostname inside, and what ``--link-of`` takes)."""
        return f"host{host}"

    @staticmethod
    def address(host: int) -> str:
        """Host ``host``'s address (only inside the emulated network)."""
        return f"{SUBNET}.{host + 1}"

    def describe(self) -> str:
        """``4 emulated hosts, links 1gbit (host3: 100mbit)``."""
        links = format_rate(self.link) if self.link else "unshaped"
        if self.link_of:
            links += " (" + ", ".join(f"{self.name(h)}: {format_rate(r)}" for h, r in sorted(self.link_of.items())) + ")"
        text = f"{self.count} emulated host{'s' if self.count != 1 else ''}, links {links}"
        return text + (f", latency {self.latency * 1e3:g}ms" if self.latency else "")


def _host_index(text: str, count: int) -> int | None:
    digits = text[4:] if text.lower().startswith("host") else text
    if digits.isdigit() and int(digits) < count:
        return int(digits)
    return None


def place_tasks(tasks: Sequence[TaskId], spec: HostsSpec) -> dict[TaskId, int]:
    """Each task's host: round-robin in ``tasks``' order, or ``tasks_per_host`` on each host in turn."""
    k = spec.tasks_per_host
    if k is not None and k * spec.count < len(tasks):
        raise ConfigurationError(f"{len(tasks)} tasks do not fit on {spec.count} hosts with --tasks-per-host {k}: "
                                 f"give --hosts {-(-len(tasks) // k)} or more, or a larger --tasks-per-host")
    return {task: (i // k if k else i % spec.count) for i, task in enumerate(tasks)}


def plan_cluster(counts: Mapping[str, int], spec: HostsSpec) -> tuple[ClusterSpec, dict[TaskId, int]]:
    """The cluster of a job on emulated hosts (jobs in ``ClusterSpec``'s task order, each task at its
    host's address and the next free port there from ``BASE_PORT``), and each task's host."""
    jobs = [j for j in REPLICA_JOBS if counts.get(j)] + sorted(j for j, n in counts.items()
                                                               if n and j not in REPLICA_JOBS)
    order = [TaskId(job, i) for job in jobs for i in range(counts[job])]
    placement = place_tasks(order, spec)
    used: dict[int, int] = {}
    addresses: dict[str, list[str]] = {}
    for task in order:
        host = placement[task]
        addresses.setdefault(task.job, []).append(f"{spec.address(host)}:{BASE_PORT + used.get(host, 0)}")
        used[host] = used.get(host, 0) + 1
    return ClusterSpec(addresses), placement


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``stratagem launch``'s ``--hosts`` options on ``parser`` (read back by :func:`hosts_spec`)."""
    parser.add_argument("--hosts", type=int, metavar="N",
                        help="run the tasks on N emulated hosts of this machine: network namespaces joined by a "
                             "bridge, each task bound to its host's address (10.77.0.x, only inside them); "
                             "needs root (or unshare -r) and iproute2")
    parser.add_argument("--link", metavar="RATE",
                        help="with --hosts: shape every host's link to RATE in both directions (100mbit, 1gbit, "
                             "10gbit; default: not shaped)")
    parser.add_argument("--link-of", action="append", default=[], metavar="HOST=RATE",
                        help="with --hosts: one host's link rate (host3=100mbit: a straggler); repeatable")
    parser.add_argument("--tasks-per-host", type=int, metavar="K",
                        help="with --hosts: K tasks on each host in turn (default: round-robin over the hosts)")
    parser.add_argument("--latency", metavar="DELAY",
                        help="with --hosts: one-way delay between two hosts (5ms; needs the kernel's netem)")


def hosts_spec(args: argparse.Namespace) -> HostsSpec | None:
    """``--hosts`` and its options, parsed by ``stratagem launch``, as a spec (None without ``--hosts``),
    refusing what does not go with them (``--mpi``, ``--ray``; ``--link`` without ``--hosts``)."""
    given = [flag for flag, value in (("--link", getattr(args, "link", None)),
                                      ("--link-of", getattr(args, "link_of", None) or None),
                                      ("--tasks-per-host", getattr(args, "tasks_per_host", None)),
                                      ("--latency", getattr(args, "latency", None))) if value is not None]
    if getattr(args, "hosts", None) is None:
        if given:
            raise ConfigurationError(f"{', '.join(given)}: only with --hosts N (emulated hosts)")
        return None
    if getattr(args, "mpi", False) or getattr(args, "ray", None):
        raise ConfigurationError("--hosts works with the local launcher only, not with --mpi or --ray")
    return HostsSpec.parse(args.hosts, link=args.link, link_of=args.link_of, latency=args.latency,
                           tasks_per_host=args.tasks_per_host)


@functools.lru_cache(maxsize=None)
def missing_tools() -> str | None:
    """What this machine lacks for emulated hosts (Linux, ``ip``, ``tc``), or None."""
    if not sys.platform.startswith("linux"):
        return "emulated hosts need Linux (network namespaces)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"emulated hosts need {' and '.join(repr(t) for t in missing)} (iproute2): install it "
                f"(apt-get install iproute2)")
    return None


def bucket_bytes(rate: int) -> int:
    """The token bucket's depth (``burst``, bytes of frames): 2 ms at the rate, and at least 96 KiB, so
    a full 64 KiB segment (GSO) passes whole. A link that idled that long sends this much at once
    (``stratagem advise --hosts`` counts it: :mod:`stratagem.advise.hosts`)."""
    return max(rate // 8 // 500, 96 << 10)


def _shaping(dev: str, rate: int | None, delay: float | None) -> list[str]:
    """``tc -batch`` lines shaping ``dev``'s egress (nothing if neither rate nor delay)."""
    tbf = f"tbf rate {rate}bit burst {bucket_bytes(rate)} latency {QUEUE_MS}ms" if rate else ""
    if delay:
        lines = [f"qdisc add dev {dev} root handle 1: netem delay {delay * 1e6:.0f}us limit 100000"]
        if tbf:
            lines.append(f"qdisc add dev {dev} parent 1:1 handle 10: {tbf}")
        return lines
    return [f"qdisc add dev {dev} root {tbf}"] if tbf else []


def _reshaping(dev: str, rate: int | None, delayed: bool) -> str:
    """The ``tc -batch`` line that sets ``dev``'s rate at run time (a ``netem`` root, when there is
    one, is kept: the token bucket is its child)."""
    where = "parent 1:1 handle 10:" if delayed else "root"
    if rate is None:
        return f"qdisc replace dev {dev} {where} pfifo"
    return f"qdisc replace dev {dev} {where} tbf rate {rate}bit burst {bucket_bytes(rate)} latency {QUEUE_MS}ms"


class EmulatedHosts:
    """A set of emulated hosts, built by :meth:`start` (or ``with``) and removed by :meth:`close`.

    ``names`` (``host0`` ...) and ``addresses`` (``10.77.0.1`` ...) are the hosts', index by index;
    :meth:`command` runs a command inside one. See the module doc.
    """

    def __init__(self, spec: HostsSpec):
        self.spec = spec
        self.names = [spec.name(i) for i in range(spec.count)]
        self.addresses = [spec.address(i) for i in range(spec.count)]
        self._holders: list[subprocess.Popen] = []
        self._switch: subprocess.Popen | None = None
        self._hosts: list[subprocess.Popen] = []

    # -- building -----------------------------------------------------------------------------------

    def start(self) -> "EmulatedHosts":
        """Make the namespaces, the bridge and the links; a ``ConfigurationError`` says what is missing."""
        why = missing_tools()
        if why:
            raise ConfigurationError(why)
        try:
            self._switch = self._hold("switch")
            self._hosts = [self._hold(name) for name in self.names]
            for holder in self._holders:
                self._wait_ready(holder)
            if self.spec.latency:
                self._check_netem()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _hold(self, name: str) -> subprocess.Popen:
        holder = subprocess.Popen([sys.executable, "-S", "-c", _HOLDER, str(os.getpid()), name],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        self._holders.append(holder)
        return holder

    @staticmethod
    def _wait_ready(holder: subprocess.Popen) -> None:
        ready, _, _ = select.select([holder.stdout], [], [], COMMAND_TIMEOUT)
        line = holder.stdout.readline().decode(errors="replace").strip() if ready else "error no answer in time"
        if line == "ready":
            return
        reason = line[len("error "):] if line.startswith("error ") else f"exit {holder.wait()}"
        raise ConfigurationError(
            f"cannot make a network namespace for an emulated host ({reason}): emulated hosts need root "
            f"(CAP_SYS_ADMIN and CAP_NET_ADMIN), or an unprivileged user namespace: run the command under "
            f"'unshare -r', e.g. unshare -r stratagem launch --hosts 4 ..."
        )

    def _in(self, holder: subprocess.Popen, argv: Sequence[str]) -> list[str]:
        return [sys.executable, "-S", "-c", _ENTER, str(holder.pid), *argv]

    def _batch(self, holder: subprocess.Popen, tool: str, lines: list[str]) -> None:
        if not lines:
            return
        proc = subprocess.run(self._in(holder, [tool, "-batch", "-"]), input="\n".join(lines) + "\n",
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        if proc.returncode != 0:
            raise ConfigurationError(f"building the emulated hosts failed: {tool}: "
                                     f"{(proc.stderr or proc.stdout).strip() or f'exit {proc.returncode}'}")

    def _check_netem(self) -> None:
        probe = subprocess.run(self._in(self._switch, ["tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                                       "delay", "1ms"]),
                               capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        if probe.returncode != 0:
            raise ConfigurationError(
                "--latency needs the kernel's netem qdisc (sch_netem), which this kernel does not offer "
                f"({probe.stderr.strip() or f'tc exit {probe.returncode}'}): leave --latency out (links "
                "are then shaped in rate only), or load it with modprobe sch_netem where the kernel has it"
            )

    def _build(self) -> None:
        spec = self.spec
        half = spec.latency / 2 if spec.latency else None
        switch = ["link set lo up", "link add br0 type bridge", "link set br0 up"]
        for i, holder in enumerate(self._hosts):
            switch += [f"link add p{i} type veth peer name eth0 netns {holder.pid}",
                       f"link set p{i} master br0", f"link set p{i} up"]
        self._batch(self._switch, "ip", switch)
        self._batch(self._switch, "tc", [line for i in range(spec.count)
                                         for line in _shaping(f"p{i}", spec.rate_of(i), half)])
        for i, holder in enumerate(self._hosts):
            self._batch(holder, "ip", ["link set lo up", f"addr add {self.addresses[i]}/24 dev eth0",
                                       "link set eth0 up"])
            self._batch(holder, "tc", _shaping("eth0", spec.rate_of(i), half))

    # -- using --------------------------------------------------------------------------------------

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host`` (its network and hostname): a command line to start."""
        if not self._hosts:
            raise RuntimeError("the emulated hosts are not started (call start(), or use them in a with block)")
        return self._in(self._hosts[host], argv)

    def run(self, host: int, argv: Sequence[str], timeout: float = COMMAND_TIMEOUT,
            **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host`` to its end (``subprocess.run``'s keywords, output captured
        as text unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv), timeout=timeout, **kwargs)

    def set_link(self, host: int, link: "str | int | None") -> None:
        """Change host ``host``'s link while it runs (a link fault): ``"down"`` cuts it (its ``eth0``
        goes down, so nothing crosses either way; sockets stay open), a rate (``"1mbit"``, or bits/s)
        shapes it to that rate in both directions (and brings it up), None puts it back as the spec
        built it (up, at its rate, or unshaped)."""
        if not self._hosts:
            raise RuntimeError("the emulated hosts are not started (call start(), or use them in a with block)")
        if not 0 <= host < len(self._hosts):
            raise ConfigurationError(f"no host {host}: give 0..{len(self._hosts) - 1}")
        holder = self._hosts[host]
        if link == "down":
            self._batch(holder, "ip", ["link set eth0 down"])
            return
        rate = self.spec.rate_of(host) if link is None else (link if isinstance(link, int) else parse_rate(link))
        for namespace, dev in ((holder, "eth0"), (self._switch, f"p{host}")):
            self._batch(namespace, "tc", [_reshaping(dev, rate, bool(self.spec.latency))])
        self._batch(holder, "ip", ["link set eth0 up"])

    def holder_pids(self) -> list[int]:
        """The processes holding the namespaces (the switch's first): once they and the commands started
        inside the hosts are gone, so is every namespace."""
        return [h.pid for h in self._holders]

    # -- tearing down -------------------------------------------------------------------------------

    def close(self) -> None:
        """Let the holders go (and reap them): each namespace goes when the last process in it does.
        Stop the commands started inside the hosts first."""
        holders, self._holders, self._hosts, self._switch = self._holders, [], [], None
        for holder in holders:
            for stream in (holder.stdin, holder.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        deadline = time.monotonic() + 5.0
        for holder in holders:
            try:
                holder.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()

    def __enter__(self) -> "EmulatedHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
