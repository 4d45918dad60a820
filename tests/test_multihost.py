"""Training across "machines": tasks in separate network namespaces, each binding its own address.

Three namespaces (the hosts) are joined by veth pairs to a bridge that lives in a fourth namespace
(the switch), with private addresses in 10.211.<n>.0/24. Those addresses exist only inside the
namespaces this test creates; nothing outside them is ever contacted, and the machine's own network
namespace gets no interface or address. Each task runs with ``ip netns exec HOST python ...`` and a
``STRATAGEM_CONFIG`` written here, so every task binds its namespace's address and reaches the others
only over the veth links.

Runs (a) a ``mirrored`` training and (b) a ``between_graph`` (parameter-server) training, over ``zmq``
and ``grpc``. Skipped unless we are root and ``ip netns add`` works (the skip says why). Namespaces
are deleted and processes reaped in the fixture's teardown, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLE_PS = ROOT / "examples" / "linear_regression_ps.py"
HOSTS = 3
TASK_TIMEOUT = 120  # seconds a whole multi-host job may take
CMD_TIMEOUT = 20

sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT, check=check)


def _why_no_netns() -> str | None:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"sgprobe{os.getpid()}"
    try:
        made = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"'ip netns add' failed: {exc}"
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """HOSTS namespaces on one bridge; ``address(i)`` is host i's IP."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.211.{os.getpid() % 250 + 1}"
        self.switch = f"sgsw{tag}"
        self.names = [f"sgh{tag}n{i}" for i in range(HOSTS)]
        self.procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def create(self) -> None:
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            # Created directly inside the host namespace; its peer goes straight into the switch.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", sw, "link", "set", f"p{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def spawn(self, host: int, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        out = open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], sys.executable, *argv],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)
        out.close()
        self.procs.append(proc)
        return proc

    def destroy(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.names, self.switch]:
            _ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def hosts():
    reason = _why_no_netns()
    if reason:
        pytest.skip(reason)
    h = Hosts()
    try:
        try:
            h.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot build the namespace network: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
        # The hosts reach each other (and only over the bridge).
        for i in range(1, HOSTS):
            ping = subprocess.run(["ip", "netns", "exec", h.names[0], "ping", "-c", "1", "-W", "2", h.address(i)],
                                  capture_output=True, text=True, timeout=CMD_TIMEOUT)
            if ping.returncode != 0 and shutil.which("ping"):
                pytest.fail(f"{h.names[0]} cannot reach {h.address(i)}: {ping.stdout}{ping.stderr}")
        yield h
    finally:
        h.destroy()


def _env(cluster: dict, job: str, index: int, transport: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env["STRATAGEM_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    env["STRATAGEM_TRANSPORT"] = transport
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_job(hosts: Hosts, placement: dict, argv: list[str], transport: str, tmp: Path) -> dict[str, str]:
    """Start every task (job -> list of host indices), wait for all, return each task's output."""
    port = {"zmq": 24100, "grpc": 24200}[transport] + (500 if "between" in str(argv) else 0)
    cluster, tasks = {}, []
    for job, host_list in placement.items():
        cluster[job] = []
        for index, host in enumerate(host_list):
            cluster[job].append(f"{hosts.address(host)}:{port}")
            port += 1
            tasks.append((job, index, host))
    procs = {}
    for job, index, host in tasks:
        log = tmp / f"{job}_{index}.log"
        procs[f"{job}:{index}"] = (hosts.spawn(host, argv, _env(cluster, job, index, transport), log), log)
    outputs, failed = {}, []
    for name, (proc, log) in procs.items():
        try:
            code = proc.wait(timeout=TASK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            code = "timeout"
        outputs[name] = log.read_text()
        if code != 0:
            failed.append(f"{name} exited {code}:\n{outputs[name][-3000:]}")
    assert not failed, "\n".join(failed)
    return outputs


TRANSPORTS = ["zmq", "grpc"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mirrored_training_across_hosts(hosts, transport, tmp_path):
    pytest.importorskip({"zmq": "zmq", "grpc": "grpc"}[transport])
    steps, batch = 3, 24
    _run_job(hosts, {"worker": [0, 1, 2]},
             [str(SCRIPTS / "multihost_mirrored.py"), "--out", str(tmp_path), "--steps", str(steps),
              "--batch", str(batch), "--transport", transport, "--timeout", "30"],
             transport, tmp_path)
    reference = model.reference(steps, batch, "sgd")
    results = [np.load(tmp_path / f"worker_{i}.npz") for i in range(HOSTS)]
    for name in model.PARAM_NAMES:
        for r in results[1:]:  # every replica holds bitwise the same parameters
            np.testing.assert_array_equal(r[name], results[0][name])
        np.testing.assert_allclose(results[0][name], reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_between_graph_training_across_hosts(hosts, transport, tmp_path):
    pytest.importorskip({"zmq": "zmq", "grpc": "grpc"}[transport])
    # ps:0 and the chief on different hosts; host 1 runs a ps and a worker side by side.
    outputs = _run_job(hosts, {"ps": [2, 1], "worker": [0, 1]},
                       [str(EXAMPLE_PS), "--mode", "sync", "--steps", "60", "--lr", "0.5", "--batch", "50",
                        "--log-every", "1000", "--timeout", "30", "--transport", transport],
                       transport, tmp_path)
    final = re.search(r"final W = (\S+), b = (\S+) ", outputs["worker:0"])
    assert final, outputs["worker:0"]
    w, b = float(final.group(1)), float(final.group(2))
    assert abs(w - 0.1) < 0.02 and abs(b - 0.3) < 0.01, outputs["worker:0"]
    assert "2 ps, 2 worker(s), mode sync" in outputs["worker:0"]
