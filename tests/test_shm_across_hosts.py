"""transport='shm' with remote='zmq' on a cluster that spans hosts: the tasks on each host exchange
through shared-memory rings, the others over zmq, chosen automatically per peer.

Two real "hosts": two network namespaces joined by a veth pair (each its own loopback, its own abstract
Unix sockets, so shared memory can only be offered within one), made with ``unshare``/``nsenter``/``ip``;
nothing is bound or changed in this machine's own network namespace. Needs root (CAP_NET_ADMIN): skipped
with the reason otherwise. worker:0 and worker:1 run on host A, worker:2 on host B, each the plain script
tests/scripts/shm_two_hosts.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "shm_two_hosts.py"
A, B = "10.213.7.1", "10.213.7.2"
pytestmark = pytest.mark.timeout(120)


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (util-linux, iproute2)"
    if os.geteuid() != 0:
        return "needs root to make network namespaces and a veth pair"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare -n is not allowed here: {probe.stderr.decode().strip()}"
    return None


def _in(ns: subprocess.Popen, *command: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "-t", str(ns.pid), "-n", *command], capture_output=True, text=True,
                          timeout=30, check=True, **kwargs)


@pytest.fixture
def two_hosts():
    """Two network namespaces (each held by a sleeping process) joined by a veth pair: host A at
    10.213.7.1, host B at 10.213.7.2. Both go when their processes are killed, the veth pair with them."""
    why = _why_not()
    if why:
        pytest.skip(why)
    hosts = [subprocess.Popen(["unshare", "-n", "--", "sleep", "300"]) for _ in range(2)]
    try:
        # unshare may not have made its namespace yet: until it has, nsenter would enter ours, and the
        # veth pair and addresses below would land in this machine's own namespace.
        ours, deadline = os.readlink("/proc/self/ns/net"), time.monotonic() + 30
        for ns in hosts:
            while os.readlink(f"/proc/{ns.pid}/ns/net") == ours:
                assert ns.poll() is None and time.monotonic() < deadline, "unshare -n made no namespace"
                time.sleep(0.01)
        name = f"st{uuid.uuid4().hex[:6]}"
        # Made inside host A with its peer end moved straight into host B: never in our own namespace.
        _in(hosts[0], "ip", "link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b",
            "netns", str(hosts[1].pid))
        for ns, end, address in ((hosts[0], f"{name}a", A), (hosts[1], f"{name}b", B)):
            _in(ns, "ip", "link", "set", "lo", "up")
            _in(ns, "ip", "addr", "add", f"{address}/24", "dev", end)
            _in(ns, "ip", "link", "set", end, "up")
        yield hosts
    finally:
        for ns in hosts:
            ns.kill()
            ns.wait(timeout=30)


def run_job(hosts, *args):
    cluster = {"worker": [f"{A}:20001", f"{A}:20002", f"{B}:20003"]}
    placed = [hosts[0], hosts[0], hosts[1]]
    procs = []
    try:
        for index, ns in enumerate(placed):
            env = dict(os.environ, STRATAGEM_CONFIG=json.dumps({"cluster": cluster,
                                                                 "task": {"type": "worker", "index": index}}),
                       OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            env.pop("STRATAGEM_TRANSPORT", None)
            procs.append(subprocess.Popen(["nsenter", "-t", str(ns.pid), "-n", sys.executable, str(SCRIPT), *args],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        return [(p.wait(timeout=90), *p.communicate(timeout=30)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def test_same_host_peers_use_rings_and_the_others_zmq(two_hosts):
    results = run_job(two_hosts)
    for code, out, err in results:
        assert code == 0, err
    docs = {d["task"]: d for d in (json.loads(out.strip().splitlines()[-1]) for _, out, _ in results)}
    assert docs["worker:0"]["ring_peers"] == docs["worker:1"]["ring_peers"] == ["worker:0", "worker:1"]
    assert docs["worker:2"]["ring_peers"] == ["worker:2"]
    for task, doc in docs.items():
        assert doc["small"] == 6.0 and doc["large"] == [6.0, 6.0]   # 1 + 2 + 3, from every rank
        assert doc["everyone"] == [0, 1, 2]
        rank = int(task[-1])
        assert doc["heard"] == {f"worker:{r}": [float(r * i) for i in range(5)] for r in range(3) if r != rank}
    # shared memory between the two tasks of host A, in both directions; none to or from host B
    assert docs["worker:0"]["rings"] == docs["worker:1"]["rings"] == ["worker:0->worker:1", "worker:1->worker:0"]
    assert docs["worker:2"]["rings"] == []


def test_a_task_that_fails_ends_the_job_with_its_error_on_every_host(two_hosts):
    results = run_job(two_hosts, "--fail")
    codes = [code for code, _, _ in results]
    assert codes[0] == 1 and "worker:0 fails after its work" in results[0][2]
    assert codes[1:] == [0, 0], [err for _, _, err in results]   # the others had finished their work


def test_a_task_killed_on_the_other_host_is_named_by_the_others(two_hosts):
    results = run_job(two_hosts, "--die")
    assert results[2][0] == -9
    for code, _, err in results[:2]:
        assert code == 1 and "PeerLostError" in err and "worker/task:2" in err, err[-2000:]


def test_the_remote_option_says_what_it_takes():
    from stratagem.core.cluster import ClusterSpec
    from stratagem.core.errors import ConfigurationError
    from stratagem.transports.shm.transport import ShmTransport

    cluster = ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    with pytest.raises(ConfigurationError, match=r"remote must be None \(every task on this host\) or 'zmq'"):
        ShmTransport(cluster, "worker:0", remote="grpc")
    # an address of no host of ours (TEST-NET-1, never assigned): refused without the option, with the option named
    across = ClusterSpec({"worker": ["127.0.0.1:1", "192.0.2.1:2"]})
    with pytest.raises(ConfigurationError, match=r"not an address of this machine; use transport_options=\{'remote': 'zmq'\}"):
        ShmTransport(across, "worker:0")
    assert ShmTransport(across, "worker:0", remote="zmq").ring_peers == {cluster.tasks()[0]}
