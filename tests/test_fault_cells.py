"""The fault matrix's last cells (issue #23): what each fix of ``benchmarks/fault_matrix.py``'s remaining
cells must keep true, on real transports and real processes.

- A waiting ``recv()`` reads the sockets itself, in the calling (main) thread, so an exception that a
  signal handler raises there (the fault script's SIGUSR1, a user's alarm) may land while a frame is
  being handled. It is the program's, not the peer's: it must end the ``recv()``, not be taken for a
  bad frame and dropped (a serving ``in_graph`` replica then dropped the client's request, and the
  job hung to its limit).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from stratagem.core.transport import Message
from stratagem.testing.world import transport_world

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals"),
              pytest.mark.timeout(60)]


class Alarm(Exception):
    """What the signal handler raises (not a stratagem error, not a frame error)."""


def test_an_exception_a_signal_handler_raises_while_zmq_reads_ends_the_recv(caplog):
    """The main thread waits in ``recv()`` while a peer streams messages whose metadata takes a while to
    decode; an alarm raises ``Alarm`` from its handler a few milliseconds later, 40 times. Every alarm
    must come out of ``recv()``, none taken for a bad frame (the code before dropped the frame with
    "error while handling a frame: Alarm" and went on waiting, in 1 to 3 alarms of 40).

    (An alarm that lands between two parts of a message leaves the rest of it to be read as a message
    of its own, which is dropped as malformed: a program that goes on after such an exception loses
    that message. Those drops are not what this test is about.)"""
    meta = {"v": list(range(30_000))}

    def ring(signum, frame):
        raise Alarm()

    with transport_world("zmq", 2) as (sender, receiver):
        stop = threading.Event()

        def stream():
            while not stop.is_set():
                try:
                    sender.send(receiver.task, "load", Message(meta), timeout=10.0)
                except Exception:  # noqa: BLE001 - the receiver closes at the end
                    return

        feeder = threading.Thread(target=stream, daemon=True)
        feeder.start()
        previous = signal.signal(signal.SIGALRM, ring)
        outcomes = []
        try:
            receiver.recv(sender.task, "load", timeout=10.0)          # the stream is flowing
            for _ in range(40):
                signal.setitimer(signal.ITIMER_REAL, 0.004)
                deadline = time.monotonic() + 2.0
                try:
                    while time.monotonic() < deadline:
                        receiver.recv(sender.task, "load", timeout=2.0)
                    outcomes.append("not raised within 2 s")
                except Alarm:
                    outcomes.append("raised")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            stop.set()
    feeder.join(10.0)
    assert outcomes.count("raised") == len(outcomes), outcomes
    swallowed = [r.getMessage()[-200:] for r in caplog.records if "Alarm" in r.getMessage()]
    assert not swallowed, swallowed
