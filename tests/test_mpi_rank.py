"""The rank wrapper of ``stratagem launch --mpi`` (:mod:`stratagem.launch.mpi_rank`), run as a real process
in a session whose leader has already exited: only a rank told that its session is the MPI job's
(``--job-session``) reads that as its mpiexec being gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(sys.platform != "linux", reason="prctl is Linux-only")]


def _in_orphaned_session(argv: list[str]) -> int:
    """Run ``argv`` in a new session whose leader exits first; its exit status."""
    read_end, write_end = os.pipe()
    leader = os.fork()
    if leader == 0:
        try:
            os.close(read_end)
            os.setsid()
            if os.fork() == 0:
                deadline = time.monotonic() + 10
                while os.getppid() != 1 and time.monotonic() < deadline:   # the leader has gone
                    time.sleep(0.01)
                try:
                    code = subprocess.run(argv, timeout=30).returncode
                except BaseException:
                    code = 255
                os.write(write_end, str(code).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(leader, 0)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read()
    return int(answer)


def test_a_command_runs_in_a_session_whose_leader_is_gone():
    assert _in_orphaned_session([sys.executable, "-m", "stratagem.launch.mpi_rank", "sh", "-c", "exit 3"]) == 3


def test_a_rank_of_a_job_whose_mpiexec_is_gone_does_not_start():
    code = _in_orphaned_session([sys.executable, "-m", "stratagem.launch.mpi_rank", "--job-session",
                                 "sh", "-c", "exit 3"])
    assert code == 1
