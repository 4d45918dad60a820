"""The receive side of the transport contract, shared by every transport.

Incoming messages are filed by ``(source, tag)``; ``get`` waits for the next one from a given source
(or any source) under a tag. A source marked lost wakes its waiters with ``PeerLostError`` once
nothing from it is pending, so a dead peer is an error, never a hang.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import defaultdict, deque
from typing import Callable

from stratagem.core import failures
from stratagem.core.cluster import TaskId
from stratagem.core.errors import PeerLostError, TransportClosed, TransportTimeout
from stratagem.core.timeline import OFF


#: Seconds a waiter that could not read sleeps before trying to read again.
_RETRY_READ = 0.002
#: Emptied queues are forgotten once there are more than this many queues.
_SWEEP_AT = 256


class Mailbox:
    """Thread-safe store of delivered messages, keyed by (source, tag)."""

    def __init__(self, owner: TaskId, traffic=None, recorder=OFF):
        self.owner = owner
        #: The owner transport's :class:`~stratagem.core.traffic.Traffic`: deliveries from peers are counted.
        self.traffic = traffic
        #: The owner transport's timeline recorder: the time ``get`` waits on a named peer goes there.
        self.recorder = recorder
        # A plain lock under the condition, taken directly where nothing waits: ``with
        # self._lock`` is one C call, a Condition's (or an RLock's) a few Python ones.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queues: dict[tuple[TaskId, str], deque] = {}
        self._sources_by_tag: dict[str, set[TaskId]] = defaultdict(set)
        self._arrival = itertools.count()
        self._lost: dict[TaskId, str] = {}
        self._losses: dict[TaskId, int] = {}   # times each task was declared lost; never goes down
        self._closed: str | None = None
        self._sleeping = 0  # threads in get() waiting on the condition (put notifies only them)
        self._sweep_at = _SWEEP_AT

    def put(self, src: TaskId, tag: str, message) -> None:
        """File a delivered message (called by the transport's receive path)."""
        with self._lock:
            if self._closed is not None:
                return
            queue = self._queues.get((src, tag))
            if queue is None:
                queue = self._queues[(src, tag)] = deque()
                self._sources_by_tag[tag].add(src)
                if len(self._queues) > self._sweep_at:
                    self._sweep()
            queue.append((next(self._arrival), message))
            if self.traffic is not None and src != self.owner:
                self.traffic.count_received(src, message.nbytes)
            if self._sleeping:
                self._cond.notify_all()

    def _sweep(self) -> None:
        """Forget emptied queues (kept until there are many: a conversation reuses its queue for every
        message instead of making and dropping one each time, but one-off tags must not pile up)."""
        for key in [k for k, q in self._queues.items() if not q]:
            del self._queues[key]
            sources = self._sources_by_tag[key[1]]
            sources.discard(key[0])
            if not sources:
                del self._sources_by_tag[key[1]]
        self._sweep_at = max(_SWEEP_AT, 2 * len(self._queues))

    def get(self, src: TaskId | None, tag: str, timeout: float | None,
            pump: Callable[[float | None], bool] | None = None):
        """The next message under ``tag`` from ``src`` (any source if ``None``); see Transport.recv.

        ``pump(seconds)``, if given, lets the waiting thread move messages itself instead of sleeping
        until another thread files one (it saves a thread hand-off per message). It is called without
        the mailbox lock and returns False when it could not read (another thread is reading); the
        waiter then sleeps briefly and tries again.
        """
        with self._lock:
            message = self._pop(src, tag)
            if message is not None:  # already here: no deadline, no waiting
                return message
        return self._wait(src, tag, timeout, pump)

    def _wait(self, src: TaskId | None, tag: str, timeout: float | None, pump):
        """``get``'s waiting loop. It holds the lock only inside ``with`` blocks, never across ``pump``:
        an exception that a signal handler raises in this thread (the user's SIGALRM, SIGUSR1...) may
        land while the thread waits to take the lock back, and must then leave with the lock untouched,
        not release a lock this thread does not hold (``RuntimeError: release unlocked lock`` in place
        of the user's exception)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        recorder = self.recorder
        waiting_since = None  # when this call started to wait on ``src``
        while True:
            with self._lock:
                message = self._pop(src, tag)
                if message is not None:
                    if waiting_since is not None:
                        recorder.wait(src, tag, waiting_since, recorder.now())
                    return message
                if self._closed is not None:
                    raise TransportClosed(
                        f"{self.owner}: transport closed while waiting for {tag!r} ({self._closed})")
                if src is not None and src in self._lost:
                    raise PeerLostError(src, f"{self._lost[src]} (while {self.owner} waited for {tag!r})")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if waiting_since is not None:
                        recorder.wait(src, tag, waiting_since, recorder.now(), timed_out=True)
                    who = "any peer" if src is None else str(src)
                    raise TransportTimeout(
                        f"{self.owner}: no message {tag!r} from {who} within {timeout:g} s "
                        f"(is that task running and calling the same operation?)"
                    )
                if waiting_since is None and src is not None and recorder.enabled:
                    waiting_since = recorder.now()   # only the waits on a named peer: see timeline
                if pump is None:
                    self._sleep(remaining)
                    continue
            pumped = pump(remaining)
            if pumped:
                if self._sleeping:   # (read without the lock: a waiter that starts sleeping just after
                    # this sleeps no longer than _RETRY_READ, as it would if it came just after the notify)
                    with self._lock:
                        self._cond.notify_all()  # this thread stopped reading: another waiter may take over
                continue
            with self._lock:
                if not pumped:
                    # Another thread is reading and notifies when it files something; the short
                    # timeout covers the moment it stops reading, when this thread should take over.
                    self._sleep(_RETRY_READ if remaining is None else min(remaining, _RETRY_READ))

    def _sleep(self, seconds: float | None) -> None:
        self._sleeping += 1
        try:
            self._cond.wait(seconds)
        finally:
            self._sleeping -= 1

    def _pop(self, src: TaskId | None, tag: str):
        if src is None:
            sources = self._sources_by_tag.get(tag)
            if not sources:
                return None
            queues = [q for q in (self._queues[(s, tag)] for s in sources) if q]
            if not queues:
                return None
            queue = min(queues, key=lambda q: q[0][0])  # the earliest arrival
        else:
            queue = self._queues.get((src, tag))
            if not queue:
                return None
        return queue.popleft()[1]

    def notify(self) -> None:
        """Wake every waiter (a reader stopped reading: one of them may take over)."""
        with self._cond:
            self._cond.notify_all()

    def mark_lost(self, task: TaskId, reason: str) -> None:
        """Declare ``task`` gone; its waiters raise once its pending messages are consumed. Declared
        again before a new process of it came (each of its connections ends on its own): still one loss."""
        with self._cond:
            new = task not in self._lost
            if new:
                self._losses[task] = self._losses.get(task, 0) + 1
                self._lost[task] = reason
            self._cond.notify_all()
        if new:   # for the launcher, which tells a cut-off task from the peers it lost by everyone's losses
            failures.note_lost(task, reason)

    def mark_alive(self, task: TaskId, *, replaced: bool = False) -> None:
        """A new incarnation of ``task`` connected: stop reporting it lost. ``replaced``: it took the
        place of a process that was not declared lost yet (it came back before its old connection's
        loss was settled); that loss still counts, so that a waiter watching ``losses`` sees it."""
        with self._cond:
            if replaced and task not in self._lost:
                self._losses[task] = self._losses.get(task, 0) + 1
                self._cond.notify_all()
            self._lost.pop(task, None)

    def losses(self, task: TaskId) -> int:
        """How many times ``task`` was declared lost, including losses a new process of it since
        made good (``mark_alive``): a waiter can tell that the process it waits for was replaced."""
        with self._cond:
            return self._losses.get(task, 0)

    def lost(self) -> dict[TaskId, str]:
        with self._cond:
            return dict(self._lost)

    def is_lost(self, task: TaskId) -> str | None:
        # No lock: one dict read is atomic, and this runs on every send and receive.
        return self._lost.get(task)

    def close(self, reason: str = "closed") -> None:
        """Wake every waiter with ``TransportClosed`` and drop what is pending."""
        with self._cond:
            self._closed = reason
            self._queues.clear()
            self._sources_by_tag.clear()
            self._cond.notify_all()
