"""Who reads a transport's incoming traffic: a ``recv()`` that waits reads for itself, and a
background thread reads when no ``recv()`` has for a while.

Why both: a message handed from a reader thread to the thread waiting for it costs a thread wake-up
(50-100 us on a busy machine) per message, so a waiting ``recv()`` reads the sockets or rings itself
and finds its message without one. But something must read when nobody waits -- handshakes,
goodbyes, lost peers, a sender waiting for room in a ring -- and that is the background thread,
which stays away for ``grace`` seconds after a ``recv()`` read, so the two rarely contend.

One thread reads at a time (the holder of :attr:`SharedReader.lock`); a ``recv()`` that finds the
background thread reading wakes it (``wake``) so that it yields soon, and waits for its message in
the mailbox meanwhile. Used by the ``zmq`` and ``shm`` transports; the reading itself (``pump``) is
theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

#: A waiting recv() reads in slices of at most this long, and re-checks for losses and timeouts between.
USER_POLL = 0.1
#: The background thread's read slice (and how long it waits for its turn).
BACKGROUND_POLL = 0.05


class SharedReader:
    """The turn-taking of a transport's readers (see the module doc).

    ``pump(timeout)`` reads what is there, waiting up to ``timeout`` seconds for something (called
    with :attr:`lock` held); ``wake()`` makes a pump in progress return soon; ``on_crash()`` is
    called if the background thread dies of an error (after logging it), and must fail whoever
    waits, who would otherwise hang. ``grace``: how long the background thread stays away after a
    ``recv()`` read. A waiting ``recv()`` reads with ``waiter_read(timeout)`` if given (a cheaper read
    than the pump's, when the transport has one), else with the pump; ``after_read()``, if given, is
    called after each read by a caller (:meth:`for_waiter`, :meth:`read_now`), once the lock is
    released (to let another waiter take over reading, or find what was just read).
    """

    def __init__(self, name: str, pump: Callable[[float], None], wake: Callable[[], None],
                 on_crash: Callable[[], None], *, grace: float,
                 waiter_read: Callable[[float], None] | None = None,
                 after_read: Callable[[], None] | None = None):
        self.name = name
        self.lock = threading.Lock()
        #: Set when the transport closes: no more reading, by anyone.
        self.stopping = False
        self._pump, self._wake, self._on_crash = pump, wake, on_crash
        self._waiter_read, self._after_read = waiter_read or pump, after_read
        self._grace = grace
        self._user_read_at = 0.0
        self._background_reading = False
        self._nudged = threading.Event()  # ends the background thread's stay-away early (nudge())
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background thread."""
        self._thread = threading.Thread(target=self._background, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No more reading: wake the background thread and wait up to ``timeout`` for it to end.
        (Whoever closes the transport then takes :attr:`lock`, so no recv() is reading either.)"""
        self.stopping = True
        self._nudged.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def for_waiter(self, remaining: float | None) -> bool:
        """Read once for a waiting ``recv()`` with ``remaining`` seconds left (None: no deadline), for
        at most :data:`USER_POLL`. False if another thread is reading (it is asked to yield) or the
        transport is stopping. (The ``pump`` of :meth:`stratagem.transport_kit.mailbox.Mailbox.get`.)"""
        if self.stopping:
            return False
        self._user_read_at = time.monotonic()  # tells the background thread to stay away
        if not self.lock.acquire(blocking=False):
            if self._background_reading:
                self._wake()
            return False
        try:
            self._waiter_read(USER_POLL if remaining is None else min(remaining, USER_POLL))
        finally:
            self._user_read_at = time.monotonic()
            self.lock.release()
            if self._after_read is not None:
                self._after_read()
        return True

    def nudge(self) -> None:
        """Something needs reading soon even if no ``recv()`` asks for it (a connection being set up):
        the background thread stops staying away (its ``grace``) and reads at its next turn."""
        self._user_read_at = 0.0
        self._nudged.set()

    def read_now(self) -> bool:
        """Read what is there without waiting, if no other thread is reading; whether it did."""
        if self.stopping or not self.lock.acquire(blocking=False):
            return False
        try:
            self._pump(0.0)
        finally:
            self.lock.release()
            if self._after_read is not None:
                self._after_read()
        return True

    def _background(self) -> None:
        try:
            while not self.stopping:
                quiet = time.monotonic() - self._user_read_at
                if quiet < self._grace:
                    self._nudged.wait(self._grace - quiet)
                    self._nudged.clear()
                    continue
                if not self.lock.acquire(timeout=BACKGROUND_POLL):
                    continue
                self._background_reading = True
                try:
                    self._pump(BACKGROUND_POLL)
                finally:
                    self._background_reading = False
                    self.lock.release()
        except Exception:  # must never die silently: every waiter would hang
            log.exception("%s: the background reader crashed", self.name)
            self._on_crash()
