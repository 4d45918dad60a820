"""A launcher killed outright (SIGKILL) leaves its private directories (the job's state, the tasks'
failure reports) behind; the next ``stratagem launch`` removes them, and never those of a launcher
that is still running (:mod:`stratagem.launch.scratch`). Real launchers, a private TMPDIR."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(90)

LAUNCH = [sys.executable, "-m", "stratagem", "launch", "--worker", "1", "--"]


def _dirs(tmp) -> set[str]:
    return set(glob.glob(os.path.join(tmp, "stratagem-*-*")))


def _start(tmp, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([*LAUNCH, sys.executable, "-c", f"import time; time.sleep({seconds})"],
                            env=dict(os.environ, TMPDIR=str(tmp)), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_dirs(tmp, before: set[str], count: int) -> set[str]:
    deadline = time.monotonic() + 30
    while len(new := _dirs(tmp) - before) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return new


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def test_the_next_launch_removes_what_a_killed_launcher_left_and_keeps_a_live_ones(tmp_path):
    killed = _start(tmp_path, 60)
    alive = None
    try:
        left = _wait_for_dirs(tmp_path, set(), 2)          # the job's state and the failure reports
        assert len(left) == 2, left
        _kill_session(killed)                                # no finally runs: the directories stay
        assert _dirs(tmp_path) == left
        alive = _start(tmp_path, 60)
        kept = _wait_for_dirs(tmp_path, left, 2)
        assert len(kept) == 2, kept
        assert not (left & _dirs(tmp_path)), "the killed launcher's directories are still there"
        done = subprocess.run([*LAUNCH, sys.executable, "-c", "pass"], env=dict(os.environ, TMPDIR=str(tmp_path)),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert _dirs(tmp_path) == kept, "a running launcher's directories were removed, or a finished one's left"
    finally:
        for proc in (killed, alive):
            if proc is not None:
                _kill_session(proc)
