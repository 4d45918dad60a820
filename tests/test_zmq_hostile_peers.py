"""Peers that misbehave against the zmq transport, each played for real on loopback.

A frozen rank (SIGSTOP keeps its sockets open, so only silence gives it away) must be named by every
other rank within the peer timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stratagem.testing.world import local_cluster

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).parent.parent / "src"


def script_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(SCRIPTS), env.get("PYTHONPATH", "")])
    env.pop("STRATAGEM_SECRET", None)
    return env


class Ranks:
    """One round's rank processes of tests/scripts/frozen_rank.py, read line by line with a deadline;
    all are killed and reaped by ``close``."""

    def __init__(self, size: int, peer_timeout: float, logs: Path):
        self.logs = logs
        cluster = local_cluster(size)
        self.tasks = cluster.tasks()
        self.procs = []
        for task in self.tasks:
            env = script_env()
            env["STRATAGEM_CONFIG"] = json.dumps({"cluster": cluster.as_dict(),
                                                  "task": {"type": task.job, "index": task.index}})
            self.procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPTS / "frozen_rank.py"), "--peer-timeout", str(peer_timeout)],
                stdout=subprocess.PIPE, stderr=open(logs / f"{task.index}.err", "w"), env=env, text=True,
                start_new_session=True))

    def read(self, wanted: set[int], timeout: float) -> dict[int, dict]:
        """The next line of each rank in ``wanted``, parsed; fails the test on a deadline."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for index in wanted:
                selector.register(self.procs[index].stdout, selectors.EVENT_READ, index)
            while len(got) < len(wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    stuck = sorted(wanted - set(got))
                    for index in stuck:
                        os.kill(self.procs[index].pid, signal.SIGUSR1)  # faulthandler: where is it?
                    time.sleep(0.5)
                    pytest.fail(f"ranks {stuck} said nothing within {timeout} s (hang):\n" + "\n".join(
                        (self.logs / f"{index}.err").read_text() for index in stuck))
                for key, _ in selector.select(remaining):
                    index = key.data
                    line = self.procs[index].stdout.readline()
                    if not line:
                        pytest.fail(f"rank {index} exited (code {self.procs[index].wait(5)}) without a "
                                    f"word:\n" + (self.logs / f"{index}.err").read_text())
                    got[index] = json.loads(line)
                    selector.unregister(key.fileobj)
        return got

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)
            proc.stdout.close()


@pytest.mark.timeout(300)
def test_a_frozen_rank_is_named_by_every_other_rank_within_the_peer_timeout(tmp_path):
    size, peer_timeout, rounds = 4, 2.0, int(os.environ.get("FROZEN_ROUNDS", "20"))
    detect: dict[int, list[float]] = {i: [] for i in range(size)}
    failures = []
    for round_number in range(rounds):
        victim = round_number % size
        survivors = set(range(size)) - {victim}
        ranks = Ranks(size, peer_timeout, tmp_path)
        try:
            ranks.read(set(range(size)), timeout=60)          # all up and all-reducing
            time.sleep(0.2)
            os.kill(ranks.procs[victim].pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            seen = ranks.read(survivors, timeout=peer_timeout + 30)
        finally:
            ranks.close()
        for index, report in seen.items():
            took = report["at"] - frozen_at
            detect[index].append(took)
            if report["task"] != f"/job:worker/task:{victim}" or took > peer_timeout + 1.0:
                failures.append((round_number, index, round(took, 2), report["error"], report["message"]))
    times = [t for ts in detect.values() for t in ts]
    print(f"\ndetection after SIGSTOP (peer_timeout {peer_timeout} s): min {min(times):.2f} "
          f"median {statistics.median(times):.2f} max {max(times):.2f} s")
    for index, ts in detect.items():
        print(f"  rank {index}: " + " ".join(f"{t:.2f}" for t in ts))
    assert not failures, "\n".join(map(str, failures))
