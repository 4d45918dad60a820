"""Emulated hosts for tests: a cluster of network namespaces with shaped links, built and torn down
around a test (what ``stratagem launch --hosts`` runs on; :mod:`stratagem.launch.hosts`).

Test a transport or a strategy across "machines": each host has its own address and loopback, and
reaches the others only over its link (shaped with ``tc``: ``link="1gbit"``). Every process started
with :meth:`Hosts.popen` is killed and reaped when the block ends, passing or failing, and then the
namespaces go too (nothing is named in ``ip netns``; nothing is created in this machine's network)::

    import pytest
    from stratagem.testing.hosts import emulated_hosts, why_no_hosts

    def test_across_hosts(tmp_path):
        if why_no_hosts():
            pytest.skip(why_no_hosts())
        with emulated_hosts(2, link="1gbit") as hosts:
            cluster, placement = hosts.cluster({"worker": 2})          # worker:i on host i
            procs = [hosts.popen(placement[t], ["python3", "train.py"], env=hosts.task_env(cluster, t))
                     for t in cluster.tasks()]
            assert all(p.wait(timeout=60) == 0 for p in procs)
            assert hosts.throughput(0, 1, 4 << 20) > 0.8e9            # bits/s through the link

Needs Linux, root (or an unprivileged user namespace: ``unshare -r pytest ...``) and iproute2;
:func:`why_no_hosts` says what is missing, for a skip.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
from typing import Iterable, Iterator, Mapping, Sequence

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.launch.hosts import EmulatedHosts, HostsSpec, plan_cluster

#: Seconds :meth:`Hosts.throughput` and the cleanup wait at most.
WAIT = 60.0

_SINK = """
import socket, sys, time
server = socket.socket()
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
server.settimeout(float(sys.argv[3]))
print("listening", flush=True)
conn, _ = server.accept()
conn.settimeout(float(sys.argv[3]))
buf, total, first = bytearray(1 << 20), 0, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    first = first or time.perf_counter()
    total += n
print(total, time.perf_counter() - first, flush=True)
"""

_SOURCE = """
import socket, sys
conn = socket.socket()
if sys.argv[5]:
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, sys.argv[5].encode())
    except OSError as exc:
        sys.exit(f"TCP congestion control {sys.argv[5]!r} not available here ({exc.strerror}); "
                 "/proc/sys/net/ipv4/tcp_available_congestion_control lists those that are")
conn.settimeout(float(sys.argv[4]))
conn.connect((sys.argv[1], int(sys.argv[2])))
conn.sendall(bytes(int(sys.argv[3])))
conn.close()
"""


@functools.lru_cache(maxsize=None)
def why_no_hosts() -> str | None:
    """Why emulated hosts cannot be built here (for ``pytest.skip``), or None: builds one host and
    removes it."""
    try:
        with EmulatedHosts(HostsSpec(1)):
            return None
    except ConfigurationError as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"emulated hosts cannot be built here: {exc}"


class Hosts:
    """Started emulated hosts (from :func:`emulated_hosts`): names, addresses, and processes run in them."""

    def __init__(self, network: EmulatedHosts):
        self.network = network
        self.spec = network.spec
        self.names = list(network.names)
        self.addresses = list(network.addresses)
        self.processes: list[subprocess.Popen] = []

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command line that runs it inside host ``host``."""
        return self.network.command(host, argv)

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``host`` (``subprocess.Popen``'s keywords), in a process group of
        its own, killed and reaped when the hosts are torn down."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        process = subprocess.Popen(self.command(host, argv), **kwargs)
        self.processes.append(process)
        return process

    def run(self, host: int, argv: Sequence[str], timeout: float = WAIT, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host`` to its end; output captured as text unless told otherwise."""
        return self.network.run(host, argv, timeout=timeout, **kwargs)

    def cluster(self, jobs: Mapping[str, int] | int) -> tuple[ClusterSpec, dict[TaskId, int]]:
        """A cluster on these hosts (tasks placed as the spec says: round-robin by default, each at its
        host's address) and each task's host: ``cluster, placement = hosts.cluster({"worker": 4})``."""
        return plan_cluster({"worker": jobs} if isinstance(jobs, int) else jobs, self.spec)

    @staticmethod
    def task_env(cluster: ClusterSpec, task: TaskId, base: Mapping[str, str] | None = None,
                 **extra: str) -> dict[str, str]:
        """``base`` (default: this process's environment, less ``STRATAGEM_*``/``TF_CONFIG``) with the
        ``STRATAGEM_CONFIG`` of ``task`` in ``cluster``, ``PYTHONUNBUFFERED=1`` and ``extra``."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
        env["STRATAGEM_CONFIG"] = json.dumps({"cluster": cluster.as_dict(),
                                              "task": {"type": task.job, "index": task.index}})
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def throughput(self, src: int, dst: int, nbytes: int, port: int = 5201, timeout: float = WAIT) -> float:
        """Bits per second of one TCP stream of ``nbytes`` from host ``src`` to host ``dst``, timed at
        the receiver from its first byte to the end (payload only: headers are not counted)."""
        return self.streams([(src, dst)], nbytes, port=port, timeout=timeout)[0]

    def streams(self, pairs: Sequence[tuple[int, int]], nbytes: int, port: int = 5201, timeout: float = WAIT,
                congestion: str | None = None) -> list[float]:
        """Bits per second of one TCP stream of ``nbytes`` for each ``(src, dst)`` host pair, all at
        once (the i-th on ``port + i``), each timed at its receiver as :meth:`throughput` times one.
        ``congestion``: the TCP congestion control each sender asks for (``"reno"``, ``"bbr"``; set
        per socket), else the host's default. ``hosts.streams([(0, 1), (1, 0)], 8 << 20)``: a link
        busy both ways at once, as a ring all-reduce keeps it."""
        sinks = [self.popen(dst, [sys.executable, "-c", _SINK, self.addresses[dst], str(port + i), str(timeout)],
                            stdout=subprocess.PIPE, text=True) for i, (_, dst) in enumerate(pairs)]
        try:
            for (_, dst), sink in zip(pairs, sinks):
                if sink.stdout.readline().strip() != "listening":
                    raise RuntimeError(f"the receiver on {self.names[dst]} did not start (exit {sink.wait(timeout)})")
            sources = [self.popen(src, [sys.executable, "-c", _SOURCE, self.addresses[dst], str(port + i),
                                        str(nbytes), str(timeout), congestion or ""],
                                  stderr=subprocess.PIPE, text=True) for i, (src, dst) in enumerate(pairs)]
            for (src, _), source in zip(pairs, sources):
                _, err = source.communicate(timeout=timeout)
                if source.returncode != 0:
                    raise RuntimeError(f"the sender on {self.names[src]} failed: {err.strip()}")
            rates = []
            for (_, dst), sink in zip(pairs, sinks):
                total, seconds = sink.stdout.readline().split()
                sink.wait(timeout)
                if int(total) != nbytes:
                    raise RuntimeError(f"{self.names[dst]} received {total} of {nbytes} bytes")
                rates.append(int(total) * 8 / float(seconds))
            return rates
        finally:
            for sink in sinks:
                _kill(sink)

    def stop_processes(self) -> None:
        """SIGKILL every process started with :meth:`popen` (its whole group) and reap it."""
        for process in self.processes:
            _kill(process)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(WAIT)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


@contextlib.contextmanager
def emulated_hosts(count: int, link: str | None = None, link_of: Iterable[str] = (), latency: str | None = None,
                   tasks_per_host: int | None = None) -> Iterator[Hosts]:
    """``count`` emulated hosts for the ``with`` block (the arguments are ``stratagem launch --hosts``'s:
    ``link="1gbit"``, ``link_of=["host1=100mbit"]``, ``latency="5ms"``, ``tasks_per_host=2``). On
    exit, passing or failing, every process started in them is killed and reaped, then the hosts go."""
    network = EmulatedHosts(HostsSpec.parse(count, link=link, link_of=link_of, latency=latency,
                                            tasks_per_host=tasks_per_host))
    network.start()
    hosts = Hosts(network)
    try:
        yield hosts
    finally:
        try:
            hosts.stop_processes()
        finally:
            network.close()
