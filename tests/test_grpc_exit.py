"""A grpc task ends however its script ends, and its peers learn at once that it is gone.

The user's way first: ``tests/scripts/grpc_exit.py`` runs as two real processes (a communicator over
grpc, cluster from ``STRATAGEM_CONFIG``) whose first task ends without closing anything: normal end,
uncaught exception, ``sys.exit(3)``; or calls ``abort()``/``close()`` and stays alive. Every process
must exit with the right code, and the other task, blocked in ``recv`` on it, must get
``PeerLostError`` naming it. Then ``close()`` and ``abort()`` themselves: prompt whatever the peer
does (here, a peer process stopped with SIGSTOP), with no thread left in the server's handlers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc", reason="the grpc transport needs grpcio: pip install 'stratagem[grpc]'")

from stratagem.core.transport import Message  # noqa: E402
from stratagem.testing.peer import spawn_peer  # noqa: E402
from stratagem.testing.world import local_cluster  # noqa: E402
from stratagem.transports.grpc.transport import GrpcTransport  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "grpc_exit.py"
EXIT_WITHIN = 60.0  # seconds a task may take to end (it takes about one; a hang is what this catches)
PEER_TIMEOUT = 10.0  # the script's: a loss must be reported well before keepalive could notice it


@contextlib.contextmanager
def two_tasks(mode: str):
    """Start both tasks of the script; yields the processes; both are killed and reaped at the end."""
    cluster = json.loads(local_cluster(2).to_json())
    procs = []
    try:
        for index in range(2):
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = {**os.environ, "STRATAGEM_CONFIG": json.dumps(config)}
            env.pop("STRATAGEM_SECRET", None)
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), mode], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()


def finish(proc: subprocess.Popen, what: str) -> tuple[str, str]:
    """Wait for ``proc`` to exit on its own; fail (saying what it printed) if it does not."""
    try:
        return proc.communicate(timeout=EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{what} did not exit within {EXIT_WITHIN:g} s\nstdout:\n{out}\nstderr:\n{err[-3000:]}")


def assert_lost(out: str, err: str, task: str, because: str = "") -> None:
    lost = [line for line in out.splitlines() if line.startswith("LOST ")]
    assert lost, f"the waiting task got no PeerLostError\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    assert lost[0].startswith(f"LOST {task} after ") and task in lost[0].split(": ", 1)[1], lost[0]
    assert because in lost[0], lost[0]
    assert float(lost[0].split()[3]) < PEER_TIMEOUT, lost[0]  # the connection dropped, not a timeout


@pytest.mark.parametrize("mode, code", [("normal", 0), ("raise", 1), ("exit3", 3)])
def test_a_script_that_ends_without_closing_exits_and_its_peer_is_told(mode, code):
    with two_tasks(mode) as (ending, waiting):
        out0, err0 = finish(ending, f"worker:0 ({mode})")
        assert ending.returncode == code, (out0, err0[-3000:])
        if mode == "raise":
            assert "RuntimeError: the user's script failed" in err0
        out1, err1 = finish(waiting, "worker:1, which had lost its peer")
        assert waiting.returncode == 0, (out1, err1[-3000:])
        assert_lost(out1, err1, "/job:worker/task:0")


@pytest.mark.parametrize("mode, because", [("abort", "lost"), ("close", "closed its transport")])
def test_abort_and_close_tell_a_peer_while_the_process_lives_on(mode, because):
    with two_tasks(mode) as (ending, waiting):
        out1, err1 = finish(waiting, f"worker:1 (its peer called {mode})")
        assert waiting.returncode == 0, (out1, err1[-3000:])
        assert_lost(out1, err1, "/job:worker/task:0", because)
        assert ending.poll() is None  # still alive: only abort()/close() can have told worker:1
        out0, err0 = finish(ending, f"worker:0 (after {mode})")  # closes its stdin: it may end now
        assert ending.returncode == 0 and f"{mode.upper().rstrip('E')}ED" in out0, (out0, err0[-3000:])


def grpc_threads(task) -> list[str]:
    """The threads of this task's transport still running, but the channel closers (daemons that
    end when gRPC has released a channel, see ``grpc_threads.close_in_background``)."""
    prefix = f"stratagem-grpc-{task.short}-"
    return [t.name for t in threading.enumerate()
            if t.name.startswith(prefix) and "-close-" not in t.name and t.is_alive()]


@pytest.mark.parametrize("how", ["close", "abort"])
def test_close_and_abort_are_prompt_with_a_stopped_peer(how):
    cluster = local_cluster(2)
    me, other = cluster.tasks()
    transport = GrpcTransport(cluster, me, timeout=20, peer_timeout=30)
    transport.start()
    try:
        with spawn_peer("grpc", cluster, other, me, peer_timeout=30) as proc:
            transport.recv(other, "ready", timeout=60)
            transport.send(other, "echo", Message({"n": 1}))
            assert transport.recv(other, "echo", timeout=20).meta == {"n": 1}
            assert grpc_threads(me)  # the streams both ways are served
            os.kill(proc.pid, signal.SIGSTOP)  # alive, connected, and reading nothing
            try:
                # More than flow control lets through: a write stays pending on the connection.
                transport.send_async(other, "echo", Message({}, [np.zeros(32 << 20, np.uint8)]))
                time.sleep(0.3)
                started = time.monotonic()
                getattr(transport, how)()
                took = time.monotonic() - started
                # linger (1 s) for close, nothing for abort; keepalive would need 24 s to drop the peer.
                assert took < 5.0, f"{how}() took {took:.1f} s"
                deadline = time.monotonic() + 10
                while grpc_threads(me) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not grpc_threads(me), f"threads still running after {how}(): {grpc_threads(me)}"
            finally:
                os.kill(proc.pid, signal.SIGCONT)
    finally:
        transport.abort()
