"""What a transport moved: payload bytes and messages sent to and received from each peer.

Every transport counts through the same two places (``Transport._route`` for sends, ``Mailbox.put``
for deliveries), so the figures mean the same whatever the transport: the bytes of the messages'
array buffers (the payload), not the headers or the metadata around them. A collective that a
transport runs natively (MPI, NCCL) moves its bytes inside the library, where nothing can count them;
``Communicator`` records what a ring algorithm would move for it under the peer ``None`` ("the
world"), so a strategy's traffic stays comparable across transports.

``stratagem bench`` reads these counters to report the bytes a training step moves::

    >>> from stratagem.core.cluster import TaskId
    >>> traffic = Traffic()
    >>> before = traffic.snapshot()
    >>> traffic.count_sent(TaskId("ps", 0), 4096)
    >>> traffic.count_received(TaskId("ps", 0), 4096)
    >>> delta = traffic.snapshot() - before
    >>> delta.sent_bytes(), delta.received_bytes(jobs={"ps"}), delta.received_bytes(jobs={"worker"})
    (4096, 4096, 0)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable

from stratagem.core.cluster import TaskId

#: Per peer: [bytes sent, messages sent, bytes received, messages received].
_SENT_BYTES, _SENT_MESSAGES, _RECEIVED_BYTES, _RECEIVED_MESSAGES = range(4)


@dataclass(frozen=True)
class TrafficSnapshot:
    """The counters at one moment (or, subtracted, between two): ``{peer: (sent bytes, sent messages,
    received bytes, received messages)}``, peer ``None`` for native collectives."""

    peers: dict = field(default_factory=dict)

    def __sub__(self, earlier: "TrafficSnapshot") -> "TrafficSnapshot":
        zero = (0, 0, 0, 0)
        delta = {}
        for peer, now in self.peers.items():
            before = earlier.peers.get(peer, zero)
            counts = tuple(a - b for a, b in zip(now, before))
            if any(counts):
                delta[peer] = counts
        return TrafficSnapshot(delta)

    def _total(self, index: int, jobs: Iterable[str] | None, native: bool) -> int:
        wanted = None if jobs is None else set(jobs)
        total = 0
        for peer, counts in self.peers.items():
            if peer is None:
                if native:
                    total += counts[index]
            elif wanted is None or peer.job in wanted:
                total += counts[index]
        return total

    def sent_bytes(self, jobs: Iterable[str] | None = None, native: bool = True) -> int:
        """Payload bytes sent to peers of ``jobs`` (all peers if None), plus native collectives' if ``native``."""
        return self._total(_SENT_BYTES, jobs, native)

    def received_bytes(self, jobs: Iterable[str] | None = None, native: bool = True) -> int:
        """Payload bytes received from peers of ``jobs`` (all if None), plus native collectives' if ``native``."""
        return self._total(_RECEIVED_BYTES, jobs, native)

    def as_dict(self) -> dict:
        """Plain JSON-able form: ``{"worker:1": {"sent_bytes": ..., ...}, "native": {...}}``."""
        names = ("sent_bytes", "sent_messages", "received_bytes", "received_messages")
        return {("native" if peer is None else peer.short): dict(zip(names, counts))
                for peer, counts in self.peers.items()}


class Traffic:
    """Thread-safe counters of one transport endpoint (``transport.traffic``)."""

    def __init__(self):
        # A lock, not bare ``+=``: the receive path and senders run on different threads.
        self._lock = threading.Lock()
        self._peers: dict[TaskId | None, list[int]] = {}

    def _add(self, peer: TaskId | None, index: int, nbytes: int) -> None:
        with self._lock:
            counts = self._peers.get(peer)
            if counts is None:
                counts = self._peers[peer] = [0, 0, 0, 0]
            counts[index] += nbytes
            counts[index + 1] += 1

    def count_sent(self, peer: TaskId | None, nbytes: int) -> None:
        """One message of ``nbytes`` payload bytes handed over for ``peer``."""
        self._add(peer, _SENT_BYTES, nbytes)

    def count_received(self, peer: TaskId | None, nbytes: int) -> None:
        """One message of ``nbytes`` payload bytes delivered from ``peer``."""
        self._add(peer, _RECEIVED_BYTES, nbytes)

    def count_exchanged(self, peer: TaskId | None, sent: int, received: int) -> None:
        """One message of ``sent`` bytes handed over and one of ``received`` bytes delivered (a native
        collective's booking): :meth:`count_sent` and :meth:`count_received` under one lock."""
        with self._lock:
            counts = self._peers.get(peer)
            if counts is None:
                counts = self._peers[peer] = [0, 0, 0, 0]
            counts[_SENT_BYTES] += sent
            counts[_SENT_BYTES + 1] += 1
            counts[_RECEIVED_BYTES] += received
            counts[_RECEIVED_BYTES + 1] += 1

    def snapshot(self) -> TrafficSnapshot:
        with self._lock:
            return TrafficSnapshot({peer: tuple(counts) for peer, counts in self._peers.items()})
