"""`stratagem launch` with real processes: output prefixes, cluster config, secrets, failure handling,
signals, timeouts, lingering ps tasks, and that no process of a job outlives it.

The launched tasks run the small scripts in tests/scripts/. Every process a test learns of (the
launcher, tasks, grandchildren) is killed by pid and reaped at teardown if the test left it alive.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stratagem.core.cluster import ClusterResolver, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.launch import supervisor
from stratagem.launch.launcher import EXIT_TIMEOUT, LaunchResult, TaskResult, launch
from stratagem.launch.task_output import OutputPump

SCRIPTS = Path(__file__).parent / "scripts"
REPORT = [sys.executable, str(SCRIPTS / "report_task.py")]
BEHAVE = [sys.executable, str(SCRIPTS / "behave.py")]
PREFIX = re.compile(r"^\[(?P<task>[a-z]+:\d+)\] (?P<text>.*)$")

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="the launcher uses POSIX process groups"),
    pytest.mark.timeout(30),  # a hung launcher fails its test rather than the run; the fixtures still reap
]


# -- harness ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launcher() -> list[str]:
    """How to run the launcher: ``python -m stratagem launch``, or the module itself if the CLI is
    broken right now by some other subcommand's module (cli.py imports them all)."""
    probe = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--help"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode == 0 and "--ps-grace" in probe.stdout:
        return [sys.executable, "-m", "stratagem", "launch"]
    return [sys.executable, "-m", "stratagem.launch.launcher"]


def _alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (killed, not yet reaped by an init that may never reap) is dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_dead(pids, seconds: float) -> list[int]:
    """Wait up to ``seconds`` for every pid to be gone; return those still alive."""
    deadline = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture
def pids():
    """Pids a test saw; any still alive at teardown are SIGKILLed, so a failing test leaks nothing."""
    seen: list[int] = []
    yield seen
    for pid in seen:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Live:
    """A launcher running in the background, its stdout and stderr collected line by line."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=env, start_new_session=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._collect, args=(pipe, lines), daemon=True)
                         for pipe, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _collect(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, seconds: float = 10) -> None:
        deadline = time.monotonic() + seconds
        while not predicate(self.stdout):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"launcher output never got there:\n{self.text()}")
            time.sleep(0.02)

    def finish(self, seconds: float = 15) -> int:
        code = self.process.wait(timeout=seconds)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def text(self) -> str:
        return "stdout:\n" + "\n".join(self.stdout) + "\nstderr:\n" + "\n".join(self.stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def live():
    started: list[Live] = []

    def start(argv, env=None) -> Live:
        started.append(Live(argv, env))
        return started[-1]

    yield start
    for launched in started:
        launched.close()


def run_launcher(launcher, *args: str, env: dict | None = None, seconds: float = 20) -> subprocess.CompletedProcess:
    # On a hang, subprocess.run SIGKILLs the launcher and its tasks die with it (PR_SET_PDEATHSIG).
    return subprocess.run([*launcher, *args], capture_output=True, text=True, env=env, timeout=seconds)


def by_task(text: str) -> dict[str, list[str]]:
    """Group prefixed lines by task; every line must carry a prefix."""
    grouped: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = PREFIX.match(line)
        assert match, f"line without a task prefix: {line!r}"
        grouped.setdefault(match["task"], []).append(match["text"])
    return grouped


def task_pids(lines: list[str]) -> dict[str, int]:
    """``{"worker:0": pid}`` from behave.py's ``pid N`` lines in prefixed output."""
    return {m["task"]: int(m["text"].split()[1]) for m in map(PREFIX.match, lines)
            if m and m["text"].startswith("pid ")}


def summary_rows(stderr: str) -> dict[str, str]:
    """``{"worker:1": "exit 3  <- first failure", ...}`` from the launcher's summary table."""
    rows = {}
    for line in stderr.splitlines():
        match = re.match(r"^  (?P<task>[a-z]+:\d+)\s+(?P<pid>\d+)  (?P<status>.+)$", line)
        if match:
            rows[match["task"]] = match["status"]
    return rows


def reports(stdout: str) -> dict[str, dict]:
    """report_task.py's JSON line of each task."""
    return {task: json.loads(lines[0]) for task, lines in by_task(stdout).items()}


# -- what each task is told ------------------------------------------------------------------------


def test_each_task_gets_its_config_a_free_port_a_shared_secret_and_prefixed_output(launcher):
    done = run_launcher(launcher, "--chief", "--worker", "2", "--ps", "1", "--transport", "zmq", "--", *REPORT)
    assert done.returncode == 0, done.stderr

    out = by_task(done.stdout)
    assert sorted(out) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    for task, lines in out.items():
        assert lines[1] == "unterminated last line"  # flushed at exit, with its prefix
    assert sorted(by_task("\n".join(l for l in done.stderr.splitlines() if l.startswith("[")))) == sorted(out)
    assert "[worker:1] to stderr from worker:1" in done.stderr.splitlines()
    assert "finished successfully" in done.stderr.splitlines()[-1]

    got = reports(done.stdout)
    cluster = got["worker:0"]["config"]["cluster"]
    addresses = [a for job in cluster.values() for a in job]
    assert len(addresses) == 4 and len({a.rpartition(":")[2] for a in addresses}) == 4
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    for task, report in got.items():
        resolved = ClusterResolver.from_config(json.dumps(report["config"]))  # what the task itself would see
        assert resolved.task == TaskId.parse(task)
        assert report["config"]["cluster"] == cluster
        assert report["transport"] == "zmq" and report["unbuffered"] == "1"
        assert report["secret_length"] == 64  # secrets.token_hex(32)
    assert len({r["secret_sha256"] for r in got.values()}) == 1


def test_secret_is_fresh_per_job_unless_the_user_gives_one(launcher):
    import hashlib

    env = {k: v for k, v in os.environ.items() if k != "STRATAGEM_SECRET"}
    first, second = (reports(run_launcher(launcher, "--", *REPORT, env=env).stdout)["worker:0"] for _ in range(2))
    assert first["secret_sha256"] and first["secret_sha256"] != second["secret_sha256"]

    given = hashlib.sha256(b"given-by-flag").hexdigest()
    flag = reports(run_launcher(launcher, "--worker", "2", "--secret", "given-by-flag", "--", *REPORT, env=env).stdout)
    assert {r["secret_sha256"] for r in flag.values()} == {given}

    from_env = reports(run_launcher(launcher, "--", *REPORT, env={**env, "STRATAGEM_SECRET": "from-env"}).stdout)
    assert from_env["worker:0"]["secret_sha256"] == hashlib.sha256(b"from-env").hexdigest()


DEFAULT_TRANSPORT = [sys.executable, str(SCRIPTS / "default_transport.py")]


@pytest.mark.parametrize("script_args, flag, expected", [
    ([], ["--transport", "grpc"], "grpc"),                  # stratagem.communicator()
    (["strategy"], ["--transport", "grpc"], "grpc"),        # stratagem.strategy("mirrored")
    (["explicit:zmq"], ["--transport", "grpc"], "zmq"),     # a name in the code wins
    ([], [], "zmq"),                                         # no --transport: zmq
])
def test_launch_transport_is_the_transport_a_script_gets_when_it_names_none(launcher, script_args, flag, expected):
    pytest.importorskip("grpc")
    env = {k: v for k, v in os.environ.items() if k != "STRATAGEM_TRANSPORT"}
    done = run_launcher(launcher, "--worker", "2", *flag, "--", *DEFAULT_TRANSPORT, *script_args, env=env, seconds=60)
    assert done.returncode == 0, done.stdout + done.stderr
    got = reports(done.stdout)
    assert sorted(got) == ["worker:0", "worker:1"]
    for report in got.values():
        assert report["transport"] == expected and report["sum"] == 3.0, report


def test_an_unknown_transport_is_a_usage_error_with_a_did_you_mean(launcher):
    for mpi in ([], ["--mpi"]):
        done = run_launcher(launcher, *mpi, "--worker", "2", "--transport", "zqm", "--", *REPORT)
        assert done.returncode == 2, done.stderr
        assert "usage: stratagem launch" in done.stderr
        assert "--transport: unknown transport 'zqm'" in done.stderr and "did you mean 'zmq'?" in done.stderr
        assert done.stdout == ""  # nothing started


def test_an_unknown_option_gets_launchs_own_usage_not_the_top_level_one():
    done = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", "2", "--bogus", "--", *REPORT],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: stratagem launch [--worker N]"), done.stderr
    assert "stratagem launch: error: unrecognized arguments: --bogus" in done.stderr
    assert "COMMAND ..." not in done.stderr.splitlines()[0]  # not `usage: stratagem [-h] [--version] COMMAND ...`


@pytest.mark.parametrize("exit_code, status", [(0, 0), (3, 1)])
def test_a_reader_that_goes_away_leaves_the_jobs_status_and_no_traceback(exit_code, status):
    """``stratagem launch ... | head``: the job is supervised to its end all the same."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "stratagem", "launch", "--worker", "2", "--", sys.executable,
                               "-c", f"print('x' * 100); raise SystemExit({exit_code})"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write_end)
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[0].startswith("stratagem launch: ")


# -- how a job ends --------------------------------------------------------------------------------


def test_a_failing_task_stops_the_others_and_fails_the_job(launcher, pids):
    done = run_launcher(launcher, "--worker", "3", "--ps", "1", "--", *BEHAVE, "worker:1=exit:3", "*=forever")
    pids.extend(task_pids(done.stdout.splitlines()).values())

    assert done.returncode == 1, done.stderr
    assert "worker:1 exited with code 3" in done.stderr
    rows = summary_rows(done.stderr)
    assert rows["worker:1"] == "exit 3  <- first failure"
    for task in ("worker:0", "worker:2", "ps:0"):
        assert rows[task].startswith("stopped by launcher"), rows
    assert not _wait_dead(pids, 2)


class _ExitsBetweenLooks(supervisor.RunningTask):
    """A real process that has already exited with code 3, seen running at the first look of a
    supervision round and exited at the next: the interleaving of a task that exits in between."""

    def __init__(self, task, process):
        super().__init__(task, process)
        self.looks = 0

    def poll(self):
        self.looks += 1
        return None if self.looks == 1 else super().poll()


def test_a_task_that_exits_between_two_looks_is_seen_failing_not_finished():
    # A task that failed in this window was once reported as "finished successfully" (the MPI job
    # retry test caught it: mpiexec exiting 213 at once, about once in a hundred runs).
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    process.wait(30)
    task = _ExitsBetweenLooks(TaskId("worker", 0), process)
    pump = OutputPump()
    try:
        with supervisor.SignalTrap() as trap:
            outcome = supervisor.supervise([task], pump, trap, timeout=30, ps_grace=0.0, started=time.monotonic())
    finally:
        pump.close()
    assert outcome.exit_code == supervisor.EXIT_TASK_FAILED and "worker:0 exited with code 3" in outcome.reason


def test_a_task_killed_by_a_signal_is_reported_by_the_signal_name(launcher, pids):
    done = run_launcher(launcher, "--worker", "2", "--", *BEHAVE, "worker:0=kill:SIGKILL", "*=forever")
    pids.extend(task_pids(done.stdout.splitlines()).values())

    assert done.returncode == 1
    assert "worker:0 was killed by SIGKILL" in done.stderr
    assert summary_rows(done.stderr)["worker:0"] == "SIGKILL  <- first failure"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_the_launcher_stops_every_process_of_the_job(launcher, live, pids, sig, code):
    # worker:0 ignores SIGTERM, so it is only gone once the 1 s grace period ends in SIGKILL.
    job = live([*launcher, "--worker", "2", "--grace", "1", "--", *BEHAVE,
                "worker:0=ignore-term,grandchild,forever", "*=grandchild,forever"])
    job.wait_for(lambda lines: sum(l.endswith("] ready") for l in lines) == 2)
    grandchildren = [int(l.split()[-1]) for l in job.stdout if "grandchild" in l]
    pids.extend([*task_pids(job.stdout).values(), *grandchildren])
    assert len(pids) == 4 and all(_alive(p) for p in pids)

    sent = time.monotonic()
    job.process.send_signal(sig)
    assert job.finish() == code, job.text()
    assert time.monotonic() - sent < 1 + 2  # the grace period, plus slack for a loaded machine
    assert not _wait_dead(pids, 1), f"processes of the job outlived it: {job.text()}"
    rows = summary_rows("\n".join(job.stderr))
    assert rows["worker:0"] == "stopped by launcher (SIGKILL)"
    assert rows["worker:1"] == "stopped by launcher (SIGTERM)"
    assert f"interrupted by {sig.name}" in "\n".join(job.stderr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_tasks_die_with_a_launcher_that_is_killed_outright(launcher, live, pids):
    job = live([*launcher, "--worker", "2", "--", *BEHAVE, "*=forever"])
    job.wait_for(lambda lines: sum(l.endswith("] ready") for l in lines) == 2)
    pids.extend(task_pids(job.stdout).values())

    job.process.kill()  # no chance to clean up: the kernel must take the tasks along
    job.finish()
    assert not _wait_dead(pids, 3)


def test_timeout_stops_the_job_and_says_so(launcher, pids):
    started = time.monotonic()
    done = run_launcher(launcher, "--worker", "2", "--timeout", "1", "--grace", "1", "--", *BEHAVE, "*=forever")
    pids.extend(task_pids(done.stdout.splitlines()).values())

    assert done.returncode == EXIT_TIMEOUT, done.stderr
    assert "timed out after 1s" in done.stderr
    assert set(summary_rows(done.stderr).values()) == {"stopped by launcher (SIGTERM)"}
    assert time.monotonic() - started < 1 + 1 + 3
    assert not _wait_dead(pids, 1)


def test_ps_tasks_that_linger_after_the_workers_are_stopped_without_failing_the_job(launcher, pids):
    done = run_launcher(launcher, "--worker", "2", "--ps", "2", "--ps-grace", "0.5", "--", *BEHAVE,
                        "ps:0=forever", "ps:1=sleep:0.2", "*=sleep:0.2")
    pids.extend(task_pids(done.stdout.splitlines()).values())

    assert done.returncode == 0, done.stderr
    rows = summary_rows(done.stderr)
    assert rows["ps:0"] == "stopped by launcher (SIGTERM)"
    assert rows["ps:1"] == rows["worker:0"] == rows["worker:1"] == "exit 0"  # ps:1 left on its own in time
    assert "stopped ps:0" in done.stderr and "not a failure" in done.stderr
    assert not _wait_dead(pids, 1)


def test_a_ps_task_failing_on_its_own_still_fails_the_job(launcher):
    done = run_launcher(launcher, "--worker", "1", "--ps", "1", "--", *BEHAVE, "ps:0=sleep:0.3,exit:4", "*=")
    assert done.returncode == 1
    assert summary_rows(done.stderr)["ps:0"] == "exit 4  <- first failure"


# -- usage errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--worker", "2"], "no command to launch"),
    (["--worker", "2", "--"], "no command to launch"),
    (["--", "no-such-program-stratagem"], "cannot find the program"),
    (["--worker", "0", "--", "true"], "--worker N"),
])
def test_bad_invocations_are_usage_errors_naming_the_fix(launcher, args, message):
    done = run_launcher(launcher, *args)
    assert done.returncode == 2
    assert message in done.stderr and "usage:" in done.stderr


# -- the Python API --------------------------------------------------------------------------------


def test_launch_returns_each_tasks_exit_code(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    # worker:1 fails once the other two run: a task the launcher stops before it started prints nothing.
    result = launch([*BEHAVE, f"worker:1=await:2:{tmp_path},exit:3", f"*=mark:{tmp_path},forever"], workers=2,
                    chief=True, env={"EXTRA": "1"}, output=out, error_output=err, grace=2)
    assert isinstance(result, LaunchResult) and not result.ok and result.exit_code == 1
    assert result.failed_task == TaskId("worker", 1)
    assert result.returncodes == {"chief:0": -signal.SIGTERM, "worker:0": -signal.SIGTERM, "worker:1": 3}
    assert [r.stopped_by_launcher for r in result.tasks] == [True, True, False]
    assert sorted(by_task(out.getvalue())) == ["chief:0", "worker:0", "worker:1"]
    assert err.getvalue() == result.summary() + "\n"

    ok = launch([*BEHAVE, "*="], workers=1, output=out, error_output=err)
    assert ok.ok and ok.returncodes == {"worker:0": 0}
    assert "\n" not in ok.summary()  # a clean success is one line


def test_launch_rejects_bad_options_before_starting_anything():
    with pytest.raises(ConfigurationError, match="no command"):
        launch([])
    with pytest.raises(ConfigurationError, match="workers must be"):
        launch(["true"], workers=-1)
    with pytest.raises(ConfigurationError, match="timeout"):
        launch(["true"], timeout=0)
    with pytest.raises(ConfigurationError, match="secret is empty"):
        launch(["true"], secret="")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prefixes_are_coloured_per_task_on_a_terminal(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    out = _Terminal()
    result = launch([*BEHAVE, "*="], workers=2, output=out, error_output=io.StringIO())
    assert result.ok
    prefixes = {line.split("\x1b[0m")[0] for line in out.getvalue().splitlines()}
    assert len(prefixes) == 2 and all("\x1b[" in p for p in prefixes)


def test_summary_lists_every_task_with_its_pid_and_status():
    result = LaunchResult(
        cluster=None, duration=1.0, exit_code=1, reason="worker:1 was killed by SIGKILL",
        failed_task=TaskId("worker", 1),
        tasks=(TaskResult(TaskId("worker", 0), 11, -15, True), TaskResult(TaskId("worker", 1), 12, -9)),
    )
    assert summary_rows(result.summary()) == {
        "worker:0": "stopped by launcher (SIGTERM)",
        "worker:1": "SIGKILL  <- first failure",
    }
    assert result.summary().startswith("stratagem launch: FAILED: worker:1 was killed by SIGKILL")
