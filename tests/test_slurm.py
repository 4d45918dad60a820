"""Slurm job steps as clusters (stratagem.core.slurm and ClusterResolver.from_env).

- the compressed node list and tasks-per-node syntax, the block and cyclic layouts, and every refusal
  (each names the variable and the fix);
- the resolution order: srun's own PMI variables give way to the Slurm step (which adds addresses),
  mpiexec's do not;
- a real two-task "srun" job: two processes of a plain user script, started with the variables srun
  sets (node list ``localhost``, ``STRATAGEM_PORT``), resolve the same cluster and all-reduce over zmq
  and grpc.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.core import slurm
from stratagem.core.cluster import ClusterResolver, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.transport_kit.ports import MIN_PORT, ephemeral_range

SCRIPT = Path(__file__).parent / "scripts" / "slurm_allreduce.py"

pytestmark = pytest.mark.timeout(90)


def raises(call, *fragments) -> str:
    with pytest.raises(ConfigurationError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# -- parsing -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("localhost", ["localhost"]),
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),                     # padding from the first bound
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b.example.org,c[3]", ["a", "b.example.org", "c3"]),
    ("[1-2]x", ["1x", "2x"]),
])
def test_expand_nodelist(text, hosts):
    assert slurm.expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, fragment", [
    ("", "is empty"),
    ("node[1-2", "not closed"),
    ("node1-2]", "']' without '['"),
    ("n[[1]]", "nested"),
    ("n[2-1]", "goes downwards"),
    ("n[a-b]", "not a number"),
    ("n[1,,2]", "not a number"),
    ("n[]", "empty brackets"),
    ("a,,b", "empty host name"),
    ("bad host", "not a host name"),
    ("n[1-99999999]", "more than"),
])
def test_expand_nodelist_refuses_malformed_lists(text, fragment):
    raises(lambda: slurm.expand_nodelist(text, "SLURM_JOB_NODELIST"), "SLURM_JOB_NODELIST", fragment)


@pytest.mark.parametrize("text, counts", [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("1,4(x2)", [1, 4, 4])])
def test_expand_tasks_per_node(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "2(x)", "2(3)", "2x3", "-1", "2(x0)"])
def test_expand_tasks_per_node_refuses_malformed_counts(text):
    raises(lambda: slurm.expand_tasks_per_node(text, "SLURM_STEP_TASKS_PER_NODE"), "SLURM_STEP_TASKS_PER_NODE")


def test_layouts():
    assert slurm.layout(5, [2, 2, 1], "block") == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert slurm.layout(5, [2, 2, 1], "cyclic") == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    assert slurm.layout(4, [3, 1], "cyclic") == [(0, 0), (1, 0), (0, 1), (0, 2)]   # a full node is skipped


# -- resolution --------------------------------------------------------------------------------------

def step_env(rank: int, size: int = 7, **extra) -> dict:
    """The variables srun sets in task ``rank`` of a step of 7 tasks on 4 nodes laid out by block."""
    placed = slurm.layout(size, [2, 2, 2, 1])
    node, local = placed[rank]
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_STEP_NUM_TASKS": str(size),
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": str(local),
           "SLURMD_NODENAME": ["node01", "node02", "node03", "gpu1"][node],
           "SLURM_STEP_NODELIST": "node[01-03],gpu1", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
           "SLURM_JOB_NODELIST": "node[01-08],gpu[1-4]", "SLURM_TASKS_PER_NODE": "1(x12)",
           "STRATAGEM_PORT": "3000"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_every_task_of_a_step_resolves_the_same_cluster_with_addresses():
    found = [ClusterResolver.from_env(step_env(rank, STRATAGEM_NUM_PS="1")) for rank in range(7)]
    assert all(f.cluster == found[0].cluster for f in found)
    assert found[0].cluster.as_dict() == {
        "worker": ["node01:3000", "node01:3001", "node02:3000", "node02:3001", "node03:3000", "node03:3001"],
        "ps": ["gpu1:3000"]}
    assert [f.task.short for f in found] == [f"worker:{i}" for i in range(6)] + ["ps:0"]
    assert found[0].is_chief and found[0].source == "slurm (SLURM_PROCID, STRATAGEM_PORT)"
    for f in found:                      # each task's own address is on its node, at base + local id
        env = step_env(found.index(f))
        assert f.cluster.address(f.task) == f"{env['SLURMD_NODENAME']}:{3000 + int(env['SLURM_LOCALID'])}"


def test_cyclic_distribution():
    env = step_env(1, SLURM_DISTRIBUTION="cyclic:block", SLURMD_NODENAME="node02", SLURM_LOCALID="0")
    found = ClusterResolver.from_env(env)
    assert found.cluster.as_dict()["worker"][:5] == ["node01:3000", "node02:3000", "node03:3000", "gpu1:3000",
                                                     "node01:3001"]


def test_without_a_port_the_step_has_no_addresses_and_socket_transports_say_how_to_fix_it():
    found = ClusterResolver.from_env(step_env(2, STRATAGEM_PORT=None))
    assert found.task == TaskId("worker", 2) and found.cluster.address("worker:0") is None
    assert "no STRATAGEM_PORT" in found.source
    from stratagem.transports.zmq.transport import ZmqTransport

    raises(lambda: ZmqTransport(found.cluster, found.task), "no network address", "STRATAGEM_PORT", "srun",
           "transport='mpi'")


def test_without_the_step_variables_the_jobs_are_used():
    env = step_env(0, size=2, SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None, SLURM_STEP_NUM_TASKS=None,
                   SLURM_JOB_NODELIST="c[7,9]", SLURM_TASKS_PER_NODE="1(x2)", SLURMD_NODENAME="c7")
    assert ClusterResolver.from_env(env).cluster.as_dict() == {"worker": ["c7:3000", "c9:3000"]}


@pytest.mark.parametrize("extra, fragments", [
    ({"STRATAGEM_PORT": "http"}, ["STRATAGEM_PORT='http'", "not a port"]),
    ({"STRATAGEM_PORT": "70000"}, ["STRATAGEM_PORT='70000'", "not a port"]),
    ({"STRATAGEM_PORT": "65535"}, ["STRATAGEM_PORT=65535", "no room for 2 tasks per node", "lower base port"]),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
     ["STRATAGEM_PORT is set", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "srun"]),
    ({"SLURM_STEP_TASKS_PER_NODE": None, "SLURM_TASKS_PER_NODE": None},
     ["SLURM_STEP_TASKS_PER_NODE", "is not", "srun"]),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x4)"}, ["do not describe a step of 7 tasks"]),
    ({"SLURM_STEP_NODELIST": "node[01-03"}, ["SLURM_STEP_NODELIST='node[01-03'", "not closed"]),
    ({"SLURM_LOCALID": "0"}, ["SLURM_PROCID=3", "SLURM_LOCALID='0'", "--distribution=block"]),
    ({"SLURMD_NODENAME": "node07"}, ["SLURMD_NODENAME='node07'", "the layout says 'node02'"]),
    ({"SLURM_DISTRIBUTION": "plane=2"}, ["SLURM_DISTRIBUTION='plane=2'", "--distribution=block",
                                         "STRATAGEM_CONFIG"]),
    ({"SLURM_PROCID": "7"}, ["SLURM_PROCID=7", "outside the step of 7 tasks"]),
    ({"SLURM_PROCID": "x"}, ["SLURM_PROCID='x'", "not an integer"]),
])
def test_refusals_name_the_variable_and_the_fix(extra, fragments):
    raises(lambda: ClusterResolver.from_env(step_env(3, **extra)), *fragments)


def test_partial_slurm_variables_are_no_world():
    assert ClusterResolver.from_env({"SLURM_PROCID": "0"}).source.startswith("default")
    assert ClusterResolver.from_env({"SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-4]"}).source.startswith("default")


def test_a_batch_script_is_no_step():
    """sbatch's script sees the job's SLURM_PROCID=0 and SLURM_NTASKS but runs once: it is told to use srun."""
    raises(lambda: ClusterResolver.from_env(step_env(0, SLURM_STEP_ID=None, SLURM_STEP_NUM_TASKS=None)),
           "SLURM_PROCID=0 and SLURM_NTASKS=7", "not started by srun", "srun python3 train.py")
    one = step_env(0, size=1, SLURM_STEP_ID=None, SLURM_STEP_NODELIST="a", SLURM_STEP_TASKS_PER_NODE="1",
                   SLURMD_NODENAME="a")
    assert ClusterResolver.from_env(one).cluster.as_dict() == {"worker": ["a:3000"]}


def test_srun_pmi_variables_give_way_to_the_step_but_mpiexec_variables_win():
    # srun --mpi=pmix / pmi2 set PMIX_RANK / PMI_RANK to the step's rank: the step (with addresses) is used
    for rank_var, size_var in (("PMIX_RANK", "PMIX_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        found = ClusterResolver.from_env(step_env(3, **{rank_var: "3", size_var: "7"}))
        assert found.source.startswith("slurm") and found.cluster.address(found.task) == "node02:3001"
    # mpiexec inside an allocation: its ranks are not the step's (or there is no step): MPI wins
    found = ClusterResolver.from_env(step_env(3, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="16"))
    assert found.source == "mpi (OMPI_COMM_WORLD_RANK)" and found.task == TaskId("worker", 5)
    found = ClusterResolver.from_env(step_env(3, SLURM_STEP_ID=None, PMI_RANK="3", PMI_SIZE="7"))
    assert found.source == "mpi (PMI_RANK)" and found.cluster.address(found.task) is None
    # broken Slurm variables do not stand in the way of a real MPI world
    found = ClusterResolver.from_env(step_env(3, SLURM_PROCID="x", PMI_RANK="3", PMI_SIZE="7"))
    assert found.source == "mpi (PMI_RANK)"
    # and TF_CONFIG / STRATAGEM_CONFIG come first of all
    config = json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})
    assert ClusterResolver.from_env(step_env(3, TF_CONFIG=config)).source == "TF_CONFIG"


# -- a real two-task job --------------------------------------------------------------------------------

def consecutive_free_ports(count: int) -> int:
    """A base port such that base..base+count-1 were all free on 127.0.0.1 a moment ago."""
    import random

    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(MIN_PORT, ephemeral_range()[0] - count)
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError("no run of free ports found")


def run_step(tmp_path, transport: str, size: int = 2) -> list[dict]:
    """Start ``size`` processes of the user script with what srun sets on one node named localhost."""
    out = tmp_path / "out"
    out.mkdir()
    base = consecutive_free_ports(size)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM", "OMPI_", "PMI", "MV2_", "STRATAGEM_", "TF_CONFIG"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent / "src"),
                                                         env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", SLURM_NTASKS=str(size), SLURM_STEP_NUM_TASKS=str(size), SLURM_STEP_ID="0",
               SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
               SLURM_STEP_TASKS_PER_NODE=str(size), SLURM_TASKS_PER_NODE=str(size), SLURMD_NODENAME="localhost",
               STRATAGEM_PORT=str(base))
    procs = []
    try:
        for rank in range(size):
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), str(out), transport],
                env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(size)]


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
def test_two_tasks_of_a_step_resolve_the_same_cluster_and_all_reduce(tmp_path, transport):
    if transport == "grpc":
        pytest.importorskip("grpc")
    records = run_step(tmp_path, transport)
    assert records[0]["cluster"] == records[1]["cluster"]
    (port0, port1) = [int(a.rpartition(":")[2]) for a in records[0]["cluster"]["worker"]]
    assert records[0]["cluster"] == {"worker": [f"localhost:{port0}", f"localhost:{port0 + 1}"]} and port1 == port0 + 1
    assert [r["task"] for r in records] == ["worker:0", "worker:1"] and [r["rank"] for r in records] == [0, 1]
    assert all(r["source"] == "slurm (SLURM_PROCID, STRATAGEM_PORT)" for r in records)
    for r in records:
        assert r["total"] == [3.0, 3.0, 3.0]            # 1 + 2 on both
        assert r["w"] == [2.0, 2.0]                     # one step of the whole batch's mean gradient
        assert r["loss"] == pytest.approx(2.0)          # mean(0..4), weighted by rows (3 and 2)
