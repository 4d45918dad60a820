"""The client side of the parameter-server protocol: what workers and the coordinator use.

A :class:`PSClient` sends one request per shard (ps task) and gathers the replies: every request of a
call is sent first, to all the shards, and only then are the replies awaited, so the shards work
concurrently. Each shard's request carries the pieces it holds (batched: one message per shard, not
one per variable). Replies are matched to requests by id; a shard that dies while a call waits on it
raises :class:`~stratagem.ps.protocol.ShardLostError` naming it (and the pieces it held), as soon
as the transport sees it gone, and a shard that does not answer within ``timeout`` raises
``TransportTimeout`` naming it. Calls are serialised (one in flight per client).

The client also counts the acknowledgements it got, per shard and status (``acks``), for the
accounting checks (pushes acknowledged as applied == updates the servers applied).

See :mod:`stratagem.ps.server` for an example.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, defaultdict
from typing import Callable, Mapping, Sequence

from stratagem.core import job_state
from stratagem.core.cluster import TaskId
from stratagem.core.errors import CommunicationError, PeerLostError, TransportTimeout
from stratagem.ps.protocol import REPLY_TAG, REQUEST_TAG, RemoteError, ShardLostError
from stratagem.core.transport import Message, Transport

#: Longest slice a waiting call blocks in the transport before checking for lost shards.
WAIT_SLICE = 0.2


class PSClient:
    """Requests to the ps tasks of ``transport``'s cluster, batched per shard, sent concurrently.

    Args:
        transport: this task's started transport.
        timeout: seconds a call waits for every shard's reply (default: the transport's).
        pieces: ``{shard index: [piece names]}``, named in ``ShardLostError`` messages (optional).
        interrupt: ``interrupt(losing)`` is called between two slices of a wait for replies, and with
            ``losing=True`` before a shard is reported lost; it may raise to abandon the call (a
            parameter_server worker that finds it was stopped longer than its peers wait).
    """

    def __init__(self, transport: Transport, *, timeout: float | None = None,
                 pieces: Mapping[int, Sequence[str]] | None = None,
                 interrupt: Callable[[bool], None] | None = None):
        self.transport = transport
        self.interrupt = interrupt
        self.shards: list[TaskId] = transport.cluster.tasks("ps") if "ps" in transport.cluster.jobs else []
        self.timeout = timeout if timeout is not None else transport.timeout
        self.pieces: dict[int, list[str]] = {i: list(p) for i, p in (pieces or {}).items()}
        #: ``{shard index: Counter(status -> acknowledgements)}`` of pushes.
        self.acks: dict[int, Counter] = defaultdict(Counter)
        self._lock = threading.Lock()
        self._next_id = 0

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    # -- the round trip ----------------------------------------------------------------------------
    def call(self, requests: Mapping[int, Message], *, timeout: float | None = None,
             on_reply: Callable[[int, Message], None] | None = None) -> dict[int, Message]:
        """Send ``requests`` (``{shard index: Message}``), all first, then wait for every reply.

        Returns ``{shard index: reply}``; ``on_reply(index, reply)``, if given, is called with each
        successful reply as it arrives (so its data can be used while other shards still answer), and
        with each part of a reply that comes in parts (see :mod:`~stratagem.ps.protocol`): only
        the last part has the reply's status. The reply returned holds every part's names and
        buffers. A refused request raises ``RemoteError`` with the server's message (after every
        reply has arrived, so the next call starts clean).
        """
        timeout = self.timeout if timeout is None else timeout
        started = self.transport.recorder.now()
        with self._lock:
            ids: dict[int, int] = {}
            for index, message in requests.items():
                self._next_id += 1
                ids[index] = self._next_id
                message.meta["id"] = self._next_id
            self._send_all(requests, timeout)
            replies = self._gather(ids, timeout, on_reply)
        op = next((str(m.meta.get("op")) for m in requests.values()), "call")
        self.transport.recorder.record("ps", "set_optimizer" if op == "optimizer" else op, started,
                                       self._describe, requests, replies)
        return replies

    def _describe(self, requests: Mapping[int, Message], replies: dict) -> dict:
        """One round on the timeline (named by its operation: push, pull...): the bytes and shards."""
        return {"bytes_sent": sum(m.nbytes for m in requests.values()),
                "bytes_received": sum(r.nbytes for r in replies.values()),
                "peers": [str(self.shards[index]) for index in requests]}

    def _send_all(self, requests: Mapping[int, Message], timeout: float | None) -> None:
        """Start every request, then wait until the transport is done with their arrays.

        Not one by one: every shard's request is on its way before any is finished, so the shards
        start working together (a blocking send per shard made the last shard wait for the others'
        bytes). Waiting before any reply is absorbed means a reply is never copied into memory that
        a request still reads (a gradient may be a view of a variable).
        """
        handles = []
        try:
            for index, message in requests.items():
                with self._naming(index):
                    # A shard not reached yet (this task just started) may be gone with a finished job.
                    handles.append((index, job_state.wait_for_peer(
                        lambda seconds: self.transport.send_async(self.shards[index], REQUEST_TAG, message,
                                                                  timeout=seconds),
                        timeout, task=self.transport.task, what=f"parameter-server shard {self.shards[index]}")))
            for index, handle in handles:
                with self._naming(index):
                    handle.wait(timeout)
            handles = []
        finally:
            for _, handle in handles:  # failing: the caller may change its arrays once we raise
                try:
                    handle.wait(timeout)
                except CommunicationError:
                    pass

    @contextlib.contextmanager
    def _naming(self, index: int):
        """Errors sending to shard ``index`` name the shard and the pieces it holds."""
        try:
            yield
        except PeerLostError as exc:
            raise self._lost(index, exc) from None
        except TransportTimeout as exc:
            raise TransportTimeout(f"parameter-server shard {self.shards[index]}{self._holding(index)} "
                                   f"cannot be reached: {exc}") from None

    def _gather(self, ids: dict[int, int], timeout: float | None, on_reply=None) -> dict[int, Message]:
        by_task = {self.shards[index]: index for index in ids}
        replies: dict[int, Message] = {}
        parts: dict[int, list[Message]] = {}     # the earlier parts of replies that come in parts
        deadline = None if timeout is None else time.monotonic() + timeout
        # The timeline charges the time until each reply to the shard it came from (the receives here
        # take any shard's reply, so the mailbox cannot name the peer waited on).
        recorder = self.transport.recorder
        waiting_since = recorder.now()
        while len(replies) < len(ids):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                waiting = [str(self.shards[i]) for i in ids if i not in replies]
                job_state.leave_if_finished(self.transport.task, f"no reply from {', '.join(waiting)}")
                raise TransportTimeout(
                    f"{self.transport.task}: no reply from parameter-server shard(s) {', '.join(waiting)} "
                    f"within {timeout:g} s (are they running? raise timeout= for slow steps)"
                )
            try:
                wait = WAIT_SLICE if remaining is None else min(WAIT_SLICE, remaining)
                reply = self.transport.recv(None, REPLY_TAG, timeout=wait)
            except TransportTimeout:
                self._check_lost(ids, replies)
                if self.interrupt is not None:
                    self.interrupt(False)
                continue
            waiting_since = recorder.wait_until_now(reply.src, REPLY_TAG, waiting_since)
            index = by_task.get(reply.src)
            if index is None or reply.meta.get("id") != ids[index]:
                continue  # the late reply to an earlier call that timed out
            ok = "error" not in reply.meta
            if ok and on_reply is not None:
                on_reply(index, reply)
                waiting_since = recorder.now()   # copying the values in was not waiting
            if ok and reply.meta.get("part", 0) + 1 < reply.meta.get("parts", 1):
                parts.setdefault(index, []).append(reply)
                continue
            if ok and index in parts:
                reply = _joined(parts.pop(index) + [reply])
            replies[index] = reply
            self._check_lost(ids, replies)
        errors = [(i, r) for i, r in sorted(replies.items()) if "error" in r.meta]
        if errors:
            raise RemoteError("; ".join(f"{self.shards[i]}: {r.meta['error']}" for i, r in errors))
        return replies

    def _check_lost(self, ids, replies) -> None:
        lost = self.transport.lost_peers()
        for index in ids:
            if index not in replies and self.shards[index] in lost:
                raise self._lost(index, PeerLostError(self.shards[index], lost[self.shards[index]]))

    def _holding(self, index: int) -> str:
        pieces = self.pieces.get(index)
        return f" (holding {', '.join(pieces[:6])}{' ...' if len(pieces) > 6 else ''})" if pieces else ""

    def _lost(self, index: int, exc: PeerLostError) -> ShardLostError:
        # A shard that ended with a finished job is not lost: this task was stopped or slow meanwhile.
        job_state.leave_if_finished(self.transport.task, str(exc))
        if self.interrupt is not None:
            self.interrupt(True)     # a shard that dropped this task after a stall of it: not lost either
        detail = str(exc).split(": ", 1)[-1] if ": " in str(exc) else ""
        return ShardLostError(self.shards[index], self.pieces.get(index, []), detail)

    def broadcast(self, meta: dict, *, timeout: float | None = None) -> dict[int, Message]:
        """The same small request (no buffers) to every shard."""
        return self.call({i: Message(dict(meta)) for i in range(self.num_shards)}, timeout=timeout)

    # -- operations --------------------------------------------------------------------------------
    def hello(self, *, timeout: float | None = None) -> dict[int, dict]:
        return {i: r.meta for i, r in self.broadcast({"op": "hello"}, timeout=timeout).items()}

    def init(self, specs: Mapping[int, list], values: Mapping[int, list], config: dict) -> dict[int, dict]:
        """Declare pieces with their initial values (``{shard: [spec...]}``, ``{shard: [array...]}``);
        every shard gets the consistency ``config``, even one without pieces."""
        requests = {i: Message({"op": "init", "vars": list(specs.get(i, [])), "config": config},
                               list(values.get(i, []))) for i in range(self.num_shards)}
        return {i: r.meta for i, r in self.call(requests).items()}

    def ready(self) -> None:
        self.broadcast({"op": "ready"})

    def catalog(self) -> dict[int, dict]:
        return {i: r.meta for i, r in self.broadcast({"op": "catalog"}).items()}

    def set_optimizer(self, config: dict) -> None:
        self.broadcast({"op": "optimizer", "config": config})

    def pull(self, names: Mapping[int, list] | None = None) -> dict[int, Message]:
        """Values of the named pieces per shard (all pieces of every shard when ``names`` is None)."""
        if names is None:
            return self.broadcast({"op": "pull", "names": None})
        return self.call({i: Message({"op": "pull", "names": list(n)}) for i, n in names.items()})

    def pull_rows(self, rows: Mapping[int, tuple[list, list]]) -> dict[int, Message]:
        """Rows of pieces: ``{shard: (piece names, [int64 rows of each, counted from its first row])}``;
        each reply's buffers are those rows, in that order."""
        return self.call({i: Message({"op": "pull_rows", "names": list(n)}, list(r)) for i, (n, r) in rows.items()})

    def push(self, grads: Mapping[int, tuple[list, list]], *, versions: Mapping[int, int] | None = None,
             weight: float = 1.0, pull: bool = False, all_shards: bool = True,
             on_reply: Callable[[int, Message], None] | None = None,
             rows: Mapping[int, tuple[list, list, list]] | None = None,
             skip: Mapping[int, list] | None = None,
             compression: Mapping[int, dict] | None = None) -> dict[int, Message]:
        """Push ``{shard: (piece names, gradients)}``; with ``all_shards`` every shard gets a push (empty
        where there are no gradients), so every shard counts the step. ``pull`` asks each shard to
        return its values with the acknowledgement, except the pieces ``skip`` names
        (``{shard: [piece names]}``). ``rows`` adds row gradients, ``{shard: (piece names, [int64
        rows counted from each piece's first row], [their gradient rows])}``. ``compression``
        (``{shard: metadata}``, :mod:`stratagem.ps.compressed`) says a shard's gradients are compressed
        payloads. Counts the acknowledgements in ``acks``."""
        rows = rows or {}
        shards = range(self.num_shards) if all_shards else sorted(set(grads) | set(rows))
        requests = {}
        for i in shards:
            names, arrays = grads.get(i, ([], []))
            meta = {"op": "push", "names": list(names), "weight": float(weight), "pull": pull}
            arrays = list(arrays)
            if i in rows:
                row_names, indices, values = rows[i]
                meta["rows"] = list(row_names)
                for index, value in zip(indices, values):
                    arrays += [index, value]
            if skip and skip.get(i):
                meta["skip"] = list(skip[i])
            if compression and i in compression:
                meta["compression"] = compression[i]
            if versions is not None:
                meta["version"] = int(versions.get(i, 0))
            requests[i] = Message(meta, arrays)
        replies = self.call(requests, on_reply=on_reply)
        for i, reply in replies.items():
            self.acks[i][reply.meta.get("status", "?")] += 1
        return replies

    def assign(self, values: Mapping[int, tuple[list, list]]) -> None:
        self.call({i: Message({"op": "assign", "names": list(n)}, list(a)) for i, (n, a) in values.items()})

    def snapshot(self) -> dict[int, Message]:
        return self.broadcast({"op": "snapshot"})

    def load(self, shard_states: Mapping[int, tuple[dict, list]]) -> None:
        """``{shard: (meta with names/slots/iterations/step, arrays)}``."""
        self.call({i: Message({"op": "load", **meta}, list(arrays)) for i, (meta, arrays) in shard_states.items()})

    def stop(self) -> None:
        self.broadcast({"op": "stop"})

    def stats(self) -> dict[int, dict]:
        return {i: r.meta["stats"] for i, r in self.broadcast({"op": "stats"}).items()}

    def bye(self, error: str | None = None, *, timeout: float = 5.0) -> None:
        """Tell every reachable shard this task is leaving (best effort: a gone shard is skipped; after
        a finished job, none is left)."""
        if job_state.finished():
            return
        lost = self.transport.lost_peers()
        for index, shard in enumerate(self.shards):
            if shard in lost:
                continue
            try:
                self.call({index: Message({"op": "bye", "error": error})}, timeout=timeout)
            except (CommunicationError, RemoteError):
                pass


def _joined(parts: list[Message]) -> Message:
    """One reply from its parts: the last part's metadata with every part's names and buffers."""
    last = parts[-1]
    meta = {key: value for key, value in last.meta.items() if key not in ("part", "parts")}
    meta["names"] = [name for part in parts for name in part.meta.get("names") or []]
    return Message(meta, [buffer for part in parts for buffer in part.buffers], last.src)
