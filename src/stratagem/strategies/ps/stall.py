"""Noticing, from the inside, that this process was stopped longer than its peers wait for it.

A process that is stopped (SIGSTOP, a debugger, a frozen machine) keeps its sockets open, but its peers
hear nothing from it, and after their peer timeout they declare it lost and go on without it: the
``parameter_server`` coordinator runs its steps on the other workers, the shards stop answering it.
When it resumes, nothing on its own connections says so; it would wait for answers that never come.

:class:`StallWatch` notices instead: a thread wakes every :data:`TICK` seconds, and a gap of ``limit``
seconds or more between two wakes means the whole process was stopped (or starved) that long. The
worker asks :meth:`StallWatch.check` wherever it waits (between closures, and in every wait for a shard's
reply); after a stall it raises :class:`Stalled` once, and the worker comes back as a new process would
(:meth:`~stratagem.strategies.ps.parameter_server.ParameterServerStrategy`): a new transport at the same
address, a new hello to the coordinator, which then schedules onto it again.

    >>> watch = StallWatch(limit=0.5)
    >>> watch.check()                      # nothing happened
    >>> watch.note_gap(0.7)                # as the thread does after a 0.7 s stop
    >>> try:
    ...     watch.check()
    ... except Stalled as stall:
    ...     print(f"{stall.seconds:.1f}")
    0.7
    >>> watch.check()                      # once per stall
    >>> watch.close()
"""

from __future__ import annotations

import threading
import time

#: Seconds between the watching thread's wakes.
TICK = 0.1


class Stalled(BaseException):
    """This process was stopped for ``seconds`` (at least the watch's limit): its peers may have declared
    it lost. A ``BaseException``, so that a step function's ``except Exception`` does not swallow it."""

    def __init__(self, seconds: float):
        super().__init__(f"this process was stopped or starved for {seconds:.1f} s")
        self.seconds = seconds


class StallWatch:
    """Notes the gaps of ``limit`` seconds or more in this process's life (see the module doc)."""

    def __init__(self, limit: float):
        self.limit = float(limit)
        self._lock = threading.Lock()
        self._gap = 0.0               # the longest gap not reported yet
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stratagem-stall-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(TICK):
            now = time.monotonic()
            if now - last >= self.limit:
                self.note_gap(now - last)
            last = now

    def note_gap(self, seconds: float) -> None:
        """Record that the process was stopped for ``seconds`` (the thread's own finding)."""
        with self._lock:
            self._gap = max(self._gap, seconds)

    def check(self, losing: bool = False) -> None:
        """Raise :class:`Stalled` if a stall happened since the last check. ``losing``: the caller is about
        to report a peer lost, which after a stall is the stall's doing (the peers dropped this process);
        the thread may not have woken since the process resumed, so it is given a tick to."""
        if losing and not self._gap:
            time.sleep(TICK * 1.5)
        with self._lock:
            gap, self._gap = self._gap, 0.0
        if gap:
            raise Stalled(gap)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1)
