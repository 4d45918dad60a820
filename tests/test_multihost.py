"""Training across "machines": tasks in separate network namespaces, each binding its own address.

Three emulated hosts (``stratagem.testing.hosts``: network namespaces joined by veth pairs to a
bridge that lives in a namespace of its own), with private addresses in 10.77.0.0/24. Those addresses
exist only inside the namespaces; nothing outside them is ever contacted, and the machine's own network
namespace gets no interface or address. Each task runs inside its host with a ``STRATAGEM_CONFIG``
written here, so every task binds its host's address and reaches the others only over the links.

Runs (a) a ``mirrored`` training and (b) a ``between_graph`` (parameter-server) training, over ``zmq``
and ``grpc``. Skipped where emulated hosts cannot be built (the skip says why). Processes are reaped
and the namespaces go in the fixture's teardown, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
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

sys.path.insert(0, str(SCRIPTS))
import mirrored_model as model  # noqa: E402

from stratagem.testing.hosts import emulated_hosts, why_no_hosts  # noqa: E402


@pytest.fixture(scope="module")
def hosts():
    """HOSTS emulated hosts (stratagem.testing.hosts): every process started in them is killed and
    reaped, and the namespaces removed, when the module's tests are done, passed or failed."""
    reason = why_no_hosts()
    if reason:
        pytest.skip(reason)
    with emulated_hosts(HOSTS) as h:
        yield h


def _spawn(hosts, host: int, argv: list[str], env: dict, log: Path):
    with open(log, "w") as out:
        return hosts.popen(host, [sys.executable, *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                           cwd=str(ROOT))


def _env(cluster: dict, job: str, index: int, transport: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env["STRATAGEM_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    env["STRATAGEM_TRANSPORT"] = transport
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_job(hosts, placement: dict, argv: list[str], transport: str, tmp: Path) -> dict[str, str]:
    """Start every task (job -> list of host indices), wait for all, return each task's output."""
    port = {"zmq": 24100, "grpc": 24200}[transport] + (500 if "between" in str(argv) else 0)
    cluster, tasks = {}, []
    for job, host_list in placement.items():
        cluster[job] = []
        for index, host in enumerate(host_list):
            cluster[job].append(f"{hosts.addresses[host]}:{port}")
            port += 1
            tasks.append((job, index, host))
    procs = {}
    for job, index, host in tasks:
        log = tmp / f"{job}_{index}.log"
        procs[f"{job}:{index}"] = (_spawn(hosts, host, argv, _env(cluster, job, index, transport), log), log)
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
