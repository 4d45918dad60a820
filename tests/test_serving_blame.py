"""The culprit a serving task names when another worker fails (issue #23).

Under ``in_graph`` (the chief is the client, the workers serve its steps) and ``parameter_server`` (the
chief is the coordinator, the workers serve its closures), worker:1 fails while training runs: an
uncaught exception, ``sys.exit(3)``, or a SIGSTOP longer than the peer timeout. The client or
coordinator fails naming worker:1, and before it leaves it tells the other serving tasks why, so that
worker:2 stops naming worker:1 too, not "the client/coordinator worker:0 is gone".

Real processes run the plain training script (:mod:`stratagem.testing.fault_script`), each told its
place by ``STRATAGEM_CONFIG`` as ``stratagem launch`` tells it, but started here rather than by the
launcher: the launcher stops every task as soon as the first one fails, so whether worker:2 printed its
error first would be a race, and what each task says is what is checked here. (The launcher's own
summary naming the culprit is checked by the fault matrix, ``benchmarks/fault_matrix.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from stratagem.core.cluster import TaskId
from stratagem.launch.job import task_env
from stratagem.testing.strategy_contract import clean_env
from stratagem.testing.world import local_cluster

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals"),
              pytest.mark.timeout(60)]
PEER_TIMEOUT = 3.0
#: Seconds every task has to end after the fault.
LIMIT = 30.0
#: What makes fault_script raise RuntimeError (SIGUSR1) or call sys.exit(3) (SIGUSR2).
SIGNALS = {"exception": signal.SIGUSR1, "exit": signal.SIGUSR2}


class Task:
    """One task's process, its output read line by line."""

    def __init__(self, name: str, env: dict, strategy: str, on_line):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "stratagem.testing.fault_script", strategy,
                                      "--steps", "40"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._on_line = on_line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._on_line(self.name, line.rstrip("\n"))

    def error(self) -> dict | None:
        for line in self.lines:
            if line.startswith("error {"):
                return json.loads(line[len("error "):])
        return None


def run_job(strategy: str, fault: str) -> dict[str, Task]:
    """worker:0..2 (and ps:0 under parameter_server), the fault struck on worker:1 when worker:0 starts
    step 3; every task ended (killed after ``LIMIT`` s) and reaped."""
    jobs = {"worker": 3, **({"ps": 1} if strategy == "parameter_server" else {})}
    cluster = local_cluster(jobs)
    base = {**clean_env(), "STRATAGEM_PEER_TIMEOUT": str(PEER_TIMEOUT)}
    tasks: dict[str, Task] = {}
    struck = threading.Event()

    def on_line(name: str, line: str) -> None:
        if name == "worker:0" and line == "step 3" and not struck.is_set():
            struck.set()
            pid = tasks["worker:1"].proc.pid
            if fault in SIGNALS:
                tasks["worker:1"].proc.send_signal(SIGNALS[fault])
            else:
                tasks["worker:1"].proc.send_signal(signal.SIGSTOP)
                timer = threading.Timer(2 * PEER_TIMEOUT, _signal, args=(pid, signal.SIGCONT))
                timer.daemon = True
                timer.start()

    try:
        for job, count in jobs.items():
            for index in range(count):
                task = TaskId(job, index)
                env = task_env(base, cluster, task, "blame-test-secret", "zmq")
                tasks[task.short] = Task(task.short, env, strategy, on_line)
        deadline = time.monotonic() + 40
        while not struck.is_set():
            assert time.monotonic() < deadline, _output(tasks)
            assert tasks["worker:0"].proc.poll() is None, _output(tasks)
            time.sleep(0.05)
        # The exception a signal raises lands wherever the main thread is, once: no library code may
        # swallow it (a zmq frame handler's broad `except` did; the signal was sent again here then,
        # and a second SIGUSR1 during a slow exit under load killed worker:1 with -10).
        deadline = time.monotonic() + LIMIT
        for task in tasks.values():
            try:
                task.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{task.name} still runs {LIMIT:g} s after the fault:\n{_output(tasks)}")
    finally:
        for task in tasks.values():
            if task.proc.poll() is None:
                _signal(task.proc.pid, signal.SIGCONT)
                task.proc.kill()
            task.proc.wait(timeout=10)
            task.reader.join(timeout=5)
    return tasks


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _output(tasks: dict[str, Task]) -> str:
    return "\n".join(f"[{t.name}] {line}" for t in tasks.values() for line in t.lines[-30:])


def _names_worker_1(error: dict) -> bool:
    return "/job:worker/task:1" in (error.get("task") or "") or "task:1" in error["message"] \
        or "worker:1" in error["message"]


@pytest.mark.parametrize("strategy, fault", [
    ("in_graph", "exception"),
    ("in_graph", "exit"),
    ("in_graph", "sigstop_long"),
    ("parameter_server", "exception"),
    ("parameter_server", "exit"),
])
def test_every_task_names_the_failed_worker(strategy, fault):
    tasks = run_job(strategy, fault)
    output = _output(tasks)
    for name in ("worker:0", "worker:2"):
        assert tasks[name].proc.returncode not in (0, None), f"{name} did not fail:\n{output}"
        error = tasks[name].error()
        assert error is not None, f"{name} printed no error:\n{output}"
        assert _names_worker_1(error), f"{name} does not name worker:1: {error}\n{output}"
        # The serving task says the job failed because of worker:1, not that its client/coordinator is gone.
        if name == "worker:2":
            assert "because /job:worker/task:1 failed" in error["message"] or "worker:1 failed" in \
                error["message"], error
    if strategy == "parameter_server":
        assert "worker:1 failed" in "\n".join(tasks["ps:0"].lines), output
        assert tasks["ps:0"].proc.returncode != 0, output
    if fault != "sigstop_long":
        assert tasks["worker:1"].proc.returncode == (3 if fault == "exit" else 1), output


@pytest.mark.timeout(120)
def test_the_launcher_follows_a_serving_tasks_blame_to_the_failed_worker():
    """Under the launcher, a serving task that stops because worker:1 failed blames worker:1 in its
    failure report, so the launcher names worker:1 even when that serving task exits first."""
    from stratagem.testing.faults import run_fault

    outcome = run_fault("in_graph", "zmq", "worker:1", "exit", peer_timeout=3.0)
    assert outcome.exit_code == 1 and outcome.launcher_culprit == "worker:1", outcome.reason + outcome.output[-3000:]
