"""Jobs on Ray (``stratagem launch --ray``, ``stratagem.ray.run``), on a real Ray cluster started here.

The cluster is two Ray nodes on this machine (one CPU each: two CPUs in all), bound to 127.0.0.1,
without a dashboard, shut down when the module's tests are done. Every job runs as a user runs it: a
script in a subprocess that connects to the cluster as a Ray driver. Training under Ray must end
exactly as under ``stratagem launch``: the examples print the same parameters.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.timeout(120)

#: One math thread per process: the tasks share the machine's two cores with the Ray nodes.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a two-node Ray cluster on loopback (1 CPU per node), stopped afterwards."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'stratagem[ray]')")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        yield cluster.address
    finally:
        cluster.shutdown()


def _env() -> dict:
    return {**os.environ, **THREADS, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _stratagem(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratagem", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)


def _lines(output: str, task: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"[{task}] ")]


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def test_mirrored_training_matches_stratagem_launch(ray_cluster):
    """Two mirrored replicas, one per Ray node (--spread): the chief prints what it prints under launch."""
    train = ["--", sys.executable, str(EXAMPLES / "linear_regression.py"), "--steps", "40"]
    local = _stratagem("launch", "--worker", "2", "--timeout", "90", *train)
    on_ray = _stratagem("launch", "--ray", ray_cluster, "--spread", "--worker", "2", "--timeout", "90", *train)
    assert local.returncode == 0, local.stderr
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr
    chief = _lines(local.stdout, "worker:0")
    assert any(line.startswith("[worker:0] final W = ") for line in chief), local.stdout
    assert _lines(on_ray.stdout, "worker:0") == chief
    assert "stratagem launch: all 2 tasks finished successfully" in on_ray.stderr


def test_between_graph_training_matches_stratagem_launch(ray_cluster):
    """One ps task and two sync workers, packed onto the two nodes: the same final W and b."""
    train = ["--", sys.executable, str(EXAMPLES / "linear_regression_ps.py"), "--mode", "sync", "--steps", "30",
             "--log-every", "10"]
    local = _stratagem("launch", "--worker", "2", "--ps", "1", "--timeout", "90", *train)
    on_ray = _stratagem("launch", "--ray", ray_cluster, "--cpus-per-task", "0.5", "--worker", "2", "--ps", "1",
                        "--timeout", "90", *train)
    assert local.returncode == 0, local.stderr
    assert on_ray.returncode == 0, on_ray.stdout + on_ray.stderr

    def final(output):
        found = [line for line in _lines(output, "worker:0") if "final W" in line]
        assert found, output
        return re.search(r"final W = \S+, b = \S+", found[0]).group(0)

    assert final(on_ray.stdout) == final(local.stdout)
    assert "stratagem launch: all 3 tasks finished successfully" in on_ray.stderr


def test_python_api_runs_a_function_on_every_task(ray_cluster):
    """``stratagem.ray.run(train, worker=2, spread=True)`` from a user's script: each task's return value
    comes back, the tasks were on two different nodes, and the job was authenticated."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ray_function.py"), ray_cluster, "--spread"],
                          capture_output=True, text=True, timeout=100, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exit_code"] == 0
    assert result["values"] == {
        f"worker:{i}": {"task": f"worker:{i}", "rank": i, "sum": [3.0] * 4, "authenticated": True} for i in range(2)
    }
    assert len(set(result["nodes"].values())) == 2  # STRICT_SPREAD: one task per node
    assert all(a.startswith("127.0.0.1:") for a in result["cluster"]["worker"])
    assert "[worker:1] rank 1 of 2: sum 3" in proc.stdout.splitlines()


def test_python_api_runs_a_script_on_every_task(ray_cluster):
    """``stratagem.ray.run("allreduce_demo.py", worker=2, args=[...])``: the script's own check passes."""
    code = ("import sys, stratagem\n"
            "result = stratagem.ray.run(sys.argv[1], worker=2, address=sys.argv[2], cpus_per_task=0.5, timeout=90,\n"
            "                           args=['--length', '1001', '--iters', '1'])\n"
            "sys.exit(result.exit_code)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(EXAMPLES / "allreduce_demo.py"), ray_cluster],
                          capture_output=True, text=True, timeout=100, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result check PASSED" in proc.stdout
    assert "[worker:1] rank 1/2 (/job:worker/task:1): local check ok" in proc.stdout.splitlines()


def test_a_failed_task_stops_the_job_and_is_reported(ray_cluster, tmp_path):
    """worker:1 exits 3 (once worker:0 has started): worker:0 (which would sleep a minute) is stopped,
    the launcher exits 1 with the per-task table, and no process of the job is left."""
    marker = f"stratagem-ray-test-{uuid.uuid4().hex}"
    started = tmp_path / "worker0.started"
    code = (f"import os, sys, time  # {marker}\n"
            "task = os.environ['STRATAGEM_CONFIG']\n"
            "print('started', flush=True)\n"
            "if '\"index\": 1' in task:\n"
            "    deadline = time.monotonic() + 30\n"
            "    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline: time.sleep(0.05)\n"
            "    sys.exit(3)\n"
            "open(sys.argv[1], 'w').close()\n"
            "time.sleep(60)\n")
    proc = _stratagem("launch", "--ray", ray_cluster, "--cpus-per-task", "0.5", "--worker", "2", "--grace", "2",
                      "--", sys.executable, "-c", code, str(started))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[worker:0] started" in proc.stdout and "[worker:1] started" in proc.stdout
    assert "stratagem launch: FAILED: worker:1 exited with code 3; stopped the other tasks" in proc.stderr
    assert re.search(r"worker:1 +\d+ +exit 3  <- first failure", proc.stderr), proc.stderr
    assert re.search(r"worker:0 +\d+ +stopped by launcher \(SIGTERM\)", proc.stderr), proc.stderr
    assert _processes_with(marker) == []


def test_timeout_and_usage_errors(ray_cluster):
    """--timeout stops the job (124); a placement the cluster cannot make, and --ray with --mpi, are
    usage errors (2) that say why."""
    slow = _stratagem("launch", "--ray", ray_cluster, "--cpus-per-task", "0.5", "--worker", "1", "--timeout", "2",
                      "--grace", "1", "--", sys.executable, "-c", "import time; time.sleep(60)")
    assert slow.returncode == 124, slow.stderr
    assert "timed out after 2s" in slow.stderr

    spread = _stratagem("launch", "--ray", ray_cluster, "--spread", "--worker", "3", "--placement-timeout", "2",
                        "--", sys.executable, "-c", "pass")
    assert spread.returncode == 2
    assert "could not place 3 tasks (STRICT_SPREAD" in spread.stderr
    assert "3 different nodes" in spread.stderr and "2 node(s)" in spread.stderr

    both = _stratagem("launch", "--ray", ray_cluster, "--mpi", "--", sys.executable, "-c", "pass")
    assert both.returncode == 2 and "--mpi and --ray cannot be combined" in both.stderr

    with socket.socket() as probe:  # a port of this machine where nothing listens
        probe.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{probe.getsockname()[1]}"
    dead = _stratagem("launch", "--ray", nobody, "--", sys.executable, "-c", "pass", timeout=60)
    assert dead.returncode == 2 and f"nothing answers at the Ray address {nobody}" in dead.stderr


def test_without_ray_the_error_says_how_to_install_it():
    """No Ray here (its import fails): a usage error naming the extra, before anything starts."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from stratagem.cli import main\n"
            "sys.exit(main(['launch', '--ray', 'local', '--', sys.executable, '-c', 'pass']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2
    assert "Ray is not installed; install it with: pip install 'stratagem[ray]'" in proc.stderr


def test_ray_options_need_ray():
    proc = _stratagem("launch", "--spread", "--worker", "2", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert "--spread: only with --ray ADDRESS" in proc.stderr
    proc = _stratagem("launch", "--cpus-per-task", "1", "--placement-timeout", "5", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2
    assert "--cpus-per-task, --placement-timeout: only with --ray ADDRESS" in proc.stderr


def test_a_lost_actor_stops_the_job_and_is_reported(ray_cluster):
    """The actor process of worker:1 is SIGKILLed (a node lost, say): its task dies with it, the job is
    stopped and reported as a failure naming the task and its actor."""
    marker = f"stratagem-ray-test-{uuid.uuid4().hex}"
    code = (f"import os, time  # {marker}\n"
            "print('actor', os.getppid(), flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "stratagem", "launch", "--ray", ray_cluster, "--cpus-per-task",
                             "0.5", "--worker", "2", "--grace", "2", "--", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    try:
        actor = None
        for line in proc.stdout:
            if line.startswith("[worker:1] actor "):
                actor = int(line.split()[-1])
                break
        assert actor is not None, proc.stderr.read()
        os.kill(actor, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    assert "the Ray actor of worker:1 died" in err
    assert "stratagem launch: FAILED: worker:1 was killed by SIGKILL; stopped the other tasks" in err
    assert re.search(r"worker:0 +\d+ +stopped by launcher \(SIGTERM\)", err), err
    assert _processes_with(marker) == []
