"""Peers that misbehave against the zmq transport, each played for real on loopback (what every
byte-stream transport promises of a hostile peer, a forged HELLO included, is in
``stratagem.testing.byte_stream``, run for zmq in tests/test_transport_contract.py).

- a raw TCP peer speaking ZMTP claims (and sends) 1 GiB message parts before any handshake: the
  task's memory must not grow by more than a small, fixed amount, the refusal is logged, and the
  task keeps serving;
- a worker of ``parameter_server`` killed with SIGKILL and started again as a new process rejoins
  and training finishes;
- a frozen rank (SIGSTOP keeps its sockets open, so only silence gives it away) must be named by
  every other rank a peer timeout after the stop (not before it: 0.9 x, since the victim was last
  heard at most a heartbeat before; and within a tenth of it plus 1.5 s of slack after), over 20 rounds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stratagem.core.cluster import TaskId
from stratagem.core.transport import Message
from stratagem.testing.world import local_cluster, still_serves, wait_for
from stratagem.transports.zmq.transport import ZmqTransport

SCRIPTS = Path(__file__).parent / "scripts"
SRC = Path(__file__).parent.parent / "src"


TIMEOUT = 20.0
LOGGER = "stratagem.transports.zmq.transport"


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


def zmtp_flood(address: str, claimed: int, chunk: int = 1 << 20) -> tuple[socket.socket, int]:
    """Speak just enough ZMTP 3.0 (NULL mechanism, a DEALER) to start one message part that claims
    ``claimed`` bytes, then send all of it but the last byte, so that a receiver that accepts it must
    hold it all. Returns the connection, still open, and how many bytes were taken before the other
    side cut it."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + bytes(32))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(bytes([0x04, len(ready)]) + ready)               # a command, short
    s.sendall(bytes([0x02]) + struct.pack(">Q", claimed))      # a message, long, its last part
    zeros, sent = bytes(chunk), 0
    try:
        while sent < claimed - 1:
            n = min(chunk, claimed - 1 - sent)
            s.sendall(zeros[:n])
            sent += n
    except OSError:  # the other side closed the connection: what a bounded server does
        pass
    return s, sent


def zmtp_multipart_flood(address: str, parts: int, part: int = 1 << 20) -> tuple[socket.socket, int]:
    """Like :func:`zmtp_flood`, but ``parts`` parts of ``part`` bytes, each flagged "more follows",
    and never the last: every part is under any per-part limit, and libzmq holds an unfinished
    message whole. Returns the open connection and the bytes taken before the other side cut it."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    sent = 0
    try:
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + bytes(32))
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        s.sendall(bytes([0x04, len(ready)]) + ready)
        zeros = bytes(part)
        for _ in range(parts):
            s.sendall(bytes([0x03]) + struct.pack(">Q", part) + zeros)  # long, more follows
            sent += part
    except OSError:  # cut off: what a gated server does
        pass
    return s, sent


# -- memory before the handshake ---------------------------------------------------------------------

def test_an_unauthenticated_peer_claiming_gigabytes_costs_no_memory(caplog):
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", timeout=TIMEOUT) as b:
        assert still_serves(a, b)
        before = rss_bytes()
        floods = []
        try:
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                floods = [zmtp_flood(b.address, 1 << 30) for _ in range(2)]  # two connections, 1 GiB each
                time.sleep(0.5)                               # whatever the I/O thread takes, it has
                grown = rss_bytes() - before
                assert wait_for(lambda: sum("part over" in r.getMessage() for r in caplog.records) >= 2)
        finally:
            for connection, _ in floods:
                connection.close()
        taken = [sent for _, sent in floods]
        print(f"\nRSS growth with 2 x 1 GiB claimed parts pending: {grown / 2**20:.1f} MiB "
              f"(bytes taken before the cut: {taken})")
        assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.0f} MiB"
        assert all(t < (1 << 30) - 1 for t in taken)                   # cut off, not drained
        assert still_serves(a, b)
        # An authenticated peer still sends buffers far above the pre-handshake part size.
        big = np.arange(12 << 20, dtype=np.uint8)
        a.send(b.task, "big", Message({"n": 1}, [big, np.ones(3)]))
        got = b.recv(a.task, "big", timeout=TIMEOUT)
        assert got.meta == {"n": 1} and np.array_equal(got.buffers[0], big) and got.buffers[1].tolist() == [1, 1, 1]


def test_a_peer_without_the_secret_cannot_make_a_secret_cluster_hold_an_unfinished_message():
    """Parts under the size cap, flagged "more follows", never finished: libzmq would hold them all
    (no option caps a multipart message). With a secret, the connection gate refuses the peer at the
    ZMTP handshake, before it can send one part."""
    cluster = local_cluster(2)
    with ZmqTransport(cluster, "worker:0", secret=b"k", timeout=TIMEOUT) as a, \
            ZmqTransport(cluster, "worker:1", secret=b"k", timeout=TIMEOUT) as b:
        assert still_serves(a, b)
        before = rss_bytes()
        floods = []
        try:
            floods = [zmtp_multipart_flood(b.address, 256) for _ in range(2)]  # 2 x 256 MiB offered
            time.sleep(0.5)
            grown = rss_bytes() - before
        finally:
            for connection, _ in floods:
                connection.close()
        taken = [sent for _, sent in floods]
        print(f"\nRSS growth with 2 x 256 unfinished 1 MiB parts offered: {grown / 2**20:.1f} MiB "
              f"(bytes taken before the cut: {taken})")
        assert grown < 64 << 20, f"RSS grew by {grown / 2**20:.0f} MiB"
        assert b.stats["rejected_frames"] == 0                 # nothing reached the transport
        assert still_serves(a, b)


# -- a worker that comes back ------------------------------------------------------------------------

def test_a_killed_parameter_server_worker_restarted_as_a_new_process_rejoins(tmp_path):
    cluster = local_cluster({"chief": 1, "worker": 2, "ps": 1})
    script = str(SCRIPTS / "ps_coordinator.py")
    env_threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    procs: dict[str, subprocess.Popen] = {}

    def start(task: TaskId, *extra) -> subprocess.Popen:
        env = {**script_env(), **env_threads, "STRATAGEM_SECRET": "rejoin-secret",  # as launch gives
               "STRATAGEM_CONFIG": json.dumps(
            {"cluster": cluster.as_dict(), "task": {"type": task.job, "index": task.index}})}
        log = open(tmp_path / f"{task.job}_{task.index}.{len(procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, script, "--out", str(tmp_path), "--steps", "400",
                                 "--step-seconds", "0.01", *extra], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs[f"{task.short}#{len(procs)}"] = proc
        return proc

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("*.log")))

    try:
        for task in cluster.tasks():
            start(task, "--die-task", "worker:1", "--die-at", "3")
        victim = procs["worker:1#2"]
        assert victim.wait(timeout=60) == -signal.SIGKILL, logs()
        start(TaskId("worker", 1))                                  # the same task, a new process
        chief = procs["chief:0#0"]
        assert chief.wait(timeout=90) == 0, logs()
        for name, proc in procs.items():
            if proc is not victim:
                assert proc.wait(timeout=30) == 0, f"{name}\n{logs()}"
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    record = json.loads((tmp_path / "chief_0.json").read_text())
    assert record["results"] == 400, record
    assert record["executed"]["/job:worker/task:1"] > 2, record    # the old one did 2, the new one more
    assert "Address already in use" not in logs()
    assert abs(record["W"] - 0.1) < 2e-3 and abs(record["b"] - 0.3) < 2e-3, record


# -- a frozen rank -----------------------------------------------------------------------------------

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
def test_a_frozen_rank_is_named_by_every_other_rank_one_peer_timeout_after_it_froze(tmp_path):
    # 4 rounds: each rank frozen once, named by the three others (FROZEN_ROUNDS=20 for a longer hunt)
    size, peer_timeout, rounds = 4, 2.0, int(os.environ.get("FROZEN_ROUNDS", "4"))
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
            in_time = 0.9 * peer_timeout <= took <= 1.1 * peer_timeout + 1.5
            if report["task"] != f"/job:worker/task:{victim}" or not in_time:
                failures.append((round_number, index, round(took, 2), report["error"], report["message"]))
    times = [t for ts in detect.values() for t in ts]
    print(f"\ndetection after SIGSTOP (peer_timeout {peer_timeout} s): min {min(times):.2f} "
          f"median {statistics.median(times):.2f} max {max(times):.2f} s")
    for index, ts in detect.items():
        print(f"  rank {index}: " + " ".join(f"{t:.2f}" for t in ts))
    assert not failures, "\n".join(map(str, failures))
