"""A ``sync`` job's large replies take turns on the ps task's link (README: "Parameter servers").

When a sync round completes, every waiting worker is owed the new values. Sent all at once, the
replies share the ps host's way out evenly and every worker has its values only when the last byte
of all of them is out (``w`` replies of ``T`` seconds each on the wire: all arrive after ``w T``); the
workers then compute and push together, and a round takes ``2 w T``. Sent one after another, in the
order the pushes came, the first worker has its values after ``T`` and computes and pushes while the
others still receive (a link carries both directions at once): a round takes about ``(w + 1) T``.
The same holds for the values a ``parameter_server`` worker pulls when its step starts: the pulls
of a round come together, so in a sync job a pull's reply takes its turn too.

:class:`ReplyTurns` sends a reply of at least :data:`TURN_BYTES` when the one before has been
received: the reply carries ``turn: True`` and the requester's client answers, once its last part
is in, with a ``received`` request (:class:`~stratagem.ps_service.client.PSClient`). The last of a
round's replies (queued :meth:`~ReplyTurns.together`) goes without asking when nothing waits behind
it: the word would cost the requester and the server a message each and start nothing. A pull's
reply always asks: the pulls of a round come one by one, and the next may come while this one is on
the wire. A requester that
never says so (stalled, or a client that does not know the message) holds the next one up for its
*patience* only, :data:`PATIENCE_S` plus its bytes at :data:`PATIENCE_BPS`; a requester that is gone
loses its turn at once (the ones queued for it are dropped, as a send to it would fail). Smaller
replies go at once: a turn would cost them a round trip for a transfer shorter than one. So do the
replies to tasks on the ps task's own host, and every reply where fewer than two pushers are on
other hosts (the server decides: :class:`~stratagem.ps_service.server.ParameterServer`): they cross
its loopback, not the link, or have nobody to take turns with.

Every reply still goes out: :meth:`ReplyTurns.flush` sends the queued ones at once (a stop, a failed
job, the end of serving). A queued reply holds its values by reference; its :class:`TurnHandle`
keeps the server's double buffering (:mod:`~stratagem.ps_service.buffers`) off them until it is sent,
and an update that needs its array back sends it out of turn.

    >>> from stratagem.core.transport import COMPLETED
    >>> sent = []
    >>> def send(dst, meta, buffers):                # the server's: sends, returns the sends' handles
    ...     sent.append((dst, meta.get("turn"))); return [COMPLETED]
    >>> turns = ReplyTurns(send, clock=lambda: 0.0)
    >>> big = [bytearray(TURN_BYTES)]
    >>> _ = turns.reply("w1", {"id": 1}, big); _ = turns.reply("w2", {"id": 7}, big)
    >>> _ = turns.reply("w3", {"id": 2}, [bytearray(10)])    # small: at once, without a turn
    >>> sent
    [('w1', True), ('w3', None)]
    >>> turns.received("w1", 1); sent[-1], turns.queued
    (('w2', True), 0)
    >>> turns.received("w2", 7)
    >>> with turns.together():                                  # a round's replies, queued in a row
    ...     _ = turns.reply("w1", {"id": 3}, big); _ = turns.reply("w2", {"id": 8}, big)
    >>> sent[-1]
    ('w1', True)
    >>> turns.received("w1", 3); sent[-1], turns.counters["last"]  # the last, nothing behind: no word asked
    (('w2', None), 1)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from typing import Callable, Sequence

from stratagem.core.errors import ConfigurationError
from stratagem.core.transport import SendHandle

log = logging.getLogger(__name__)

#: A reply of fewer value bytes goes at once (64 KiB: at 1 Gbit/s half a millisecond on the wire,
#: about the round trip a turn costs).
TURN_BYTES = 64 << 10
#: How long a reply's turn lasts when its requester never says it was received: this many seconds,
PATIENCE_S = 1.0
#: plus its bytes at this rate (1 MB/s: a link far slower than the ones the turns are for).
PATIENCE_BPS = 1e6


class TurnHandle(SendHandle):
    """The send of a reply that may still wait for its turn: done once it was sent and every part's
    send finished; :meth:`wait` sends it out of turn if it still waits."""

    def __init__(self, start: Callable[["_Reply"], None], reply: "_Reply"):
        self._start = start
        self._reply = reply
        #: The part sends once the reply went out (empty: its requester was gone); None until then.
        self.handles: list[SendHandle] | None = None

    def done(self) -> bool:
        return self.handles is not None and all(h.done() for h in self.handles)

    def wait(self, timeout: float | None = None) -> None:
        if self.handles is None:
            self._start(self._reply)
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in self.handles or ():
            handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


class _Reply:
    """One reply that takes a turn: where it goes, what it says, its arrays and their bytes."""

    def __init__(self, dst, meta: dict, buffers: list, nbytes: int, together: bool = False):
        self.dst, self.meta, self.buffers, self.nbytes, self.together = dst, meta, buffers, nbytes, together
        self.deadline = 0.0
        self.handle: TurnHandle | None = None


class ReplyTurns:
    """Large replies one at a time, in the order they were made (see the module doc).

    Args:
        send: ``send(dst, meta, buffers)`` sends a reply now (in parts as needed) and returns its
            sends' handles, or an empty list if the requester is gone.
        patience_s, patience_Bps: a turn that is never acknowledged ends after ``patience_s`` plus
            the reply's bytes at ``patience_Bps``.
        min_bytes: replies of fewer value bytes go at once.
        clock: the clock the patience is counted on.
    """

    def __init__(self, send: Callable[..., list], *, patience_s: float = PATIENCE_S,
                 patience_Bps: float = PATIENCE_BPS, min_bytes: int = TURN_BYTES,
                 clock: Callable[[], float] = time.monotonic):
        if patience_s < 0 or patience_Bps <= 0:
            raise ConfigurationError(f"reply turns need patience_s >= 0 and patience_Bps > 0, got {patience_s!r} "
                             f"and {patience_Bps!r}")
        self._send = send
        self.patience_s, self.patience_Bps, self.min_bytes = patience_s, patience_Bps, min_bytes
        self._clock = clock
        self._queue: deque[_Reply] = deque()
        self._current: _Reply | None = None      # the reply whose turn it is, until it is received
        self._batch: list | None = None           # the replies queued together (a round's), while it lasts
        #: ``turns`` (replies sent in turn, asking for the word), ``last`` (a round's last, sent in
        #: turn without asking), ``received`` (turns the requester ended), ``waited_out``
        #: (turns that ran out of patience), ``skipped`` (requester gone), ``out_of_turn`` (sent early:
        #: a stop, a failed job, an update that needed the array).
        self.counters: Counter = Counter()

    @property
    def queued(self) -> int:
        """Replies waiting for their turn."""
        return len(self._queue)

    @contextlib.contextmanager
    def together(self):
        """Queue the replies made inside (a sync round's) in a row, then start: the one of them that
        starts with nothing queued behind it asks for no word."""
        self._batch = []
        try:
            yield self
        finally:
            batch, self._batch = self._batch, None
            for reply in batch:
                reply.together = True
                self._queue.append(reply)
            self._advance()

    def reply(self, dst, meta: dict, buffers: Sequence) -> SendHandle | list:
        """Send a reply: at once if it is small (returns its sends' handles), else in its turn
        (returns its :class:`TurnHandle`, which the caller keeps its arrays busy with)."""
        buffers = list(buffers)
        nbytes = sum(int(b.nbytes) if hasattr(b, "nbytes") else len(b) for b in buffers)
        if nbytes < self.min_bytes:
            return self._send(dst, meta, buffers)
        reply = _Reply(dst, meta, buffers, nbytes)
        reply.handle = TurnHandle(self._out_of_turn, reply)
        if self._batch is not None:
            self._batch.append(reply)
            return reply.handle
        self._queue.append(reply)
        self._advance()
        return reply.handle

    def received(self, src, request_id) -> None:
        """``src`` says it has the reply to its request ``request_id``: the next one's turn (a late
        word about a turn that ran out of patience changes nothing)."""
        current = self._current
        if current is not None and current.dst == src and current.meta.get("id") == request_id:
            self.counters["received"] += 1
            self._current = None
            self._advance()

    def check(self, lost=()) -> None:
        """End the turn of a requester in ``lost`` (and drop the replies queued for those) or of one
        out of patience; then start the next."""
        current = self._current
        if lost and self._queue:
            kept = deque()
            for reply in self._queue:
                if reply.dst in lost:
                    reply.handle.handles = []
                    self.counters["skipped"] += 1
                else:
                    kept.append(reply)
            self._queue = kept
        if current is not None:
            if current.dst in lost:
                self.counters["skipped"] += 1
                self._current = None
            elif self._clock() >= current.deadline:
                log.info("reply turns: %s did not say it received its reply (request %s, %d bytes) within "
                         "%.1f s; the next reply goes", current.dst, current.meta.get("id"), current.nbytes,
                         self._patience(current))
                self.counters["waited_out"] += 1
                self._current = None
        self._advance()

    def flush(self) -> None:
        """Send every queued reply now."""
        while self._queue:
            reply = self._queue.popleft()
            self.counters["out_of_turn"] += 1
            reply.handle.handles = self._send(reply.dst, reply.meta, reply.buffers)

    def _patience(self, reply: _Reply) -> float:
        return self.patience_s + reply.nbytes / self.patience_Bps

    def _advance(self) -> None:
        while self._current is None and self._queue:
            reply = self._queue.popleft()
            if reply.together and not self._queue:    # nothing behind it: no word to wait for
                self.counters["last"] += 1
                reply.handle.handles = self._send(reply.dst, reply.meta, reply.buffers)
                continue
            reply.meta = {**reply.meta, "turn": True}
            reply.handle.handles = self._send(reply.dst, reply.meta, reply.buffers)
            if not reply.handle.handles:       # the requester is gone: its turn is over
                self.counters["skipped"] += 1
                continue
            self.counters["turns"] += 1
            reply.deadline = self._clock() + self._patience(reply)
            self._current = reply

    def _out_of_turn(self, reply: _Reply) -> None:
        """An update needs the array ``reply`` holds: send it now, before its turn."""
        if reply in self._queue:
            self._queue.remove(reply)
            self.counters["out_of_turn"] += 1
            reply.handle.handles = self._send(reply.dst, reply.meta, reply.buffers)
