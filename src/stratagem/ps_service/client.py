"""The client side of the parameter-server protocol: what workers and the coordinator use.

A :class:`PSClient` sends one request per shard (ps task) and gathers the replies: every request of a
call is sent first, to all the shards, and only then are the replies awaited, so the shards work
concurrently. Each shard's request carries the pieces it holds (batched: one message per shard, not
one per variable). Replies are matched to requests by id; a shard that dies while a call waits on it
raises :class:`~stratagem.ps_service.protocol.ShardLostError` naming it (and the pieces it held), as soon
as the transport sees it gone, and a shard that does not answer within ``timeout`` raises
``TransportTimeout`` naming it. Calls are serialised (one in flight per client).

A reply that says ``turn: True`` (a sync job's replies with values take turns on the ps's link:
:mod:`~stratagem.ps_service.turns`) is answered, as soon as its last part is in and before the caller
sees it, with a ``received`` message, which lets the shard send the next one.

The client also counts the acknowledgements it got, per shard and status (``acks``), for the
accounting checks (pushes acknowledged as applied == updates the servers applied).

See :mod:`stratagem.ps_service.server` for an example.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from functools import partial
from typing import Callable, Iterator, Mapping, Sequence

from stratagem.core import job_state
from stratagem.core.cluster import TaskId
from stratagem.core.errors import CommunicationError, PeerLostError, TransportTimeout
from stratagem.ps_service.messages import PushReply, PushRequest
from stratagem.ps_service.protocol import REPLY_TAG, REQUEST_TAG, RemoteError, ShardLostError
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
    def call(self, requests: Mapping[int, Message], *, timeout: float | None = None) -> dict[int, Message]:
        """Send ``requests`` (``{shard index: Message}``), all first, then wait for every reply.

        Returns ``{shard index: reply}``; a reply that comes in parts (see
        :mod:`~stratagem.ps_service.protocol`) is returned whole: the last part's status with every part's
        names and buffers. A refused request raises ``RemoteError`` with the server's message (after
        every reply has arrived, so the next call starts clean).
        """
        replies: dict[int, Message] = {}
        parts: dict[int, list[Message]] = {}
        for index, message, last in self.exchange(requests, timeout=timeout):
            if not last:
                parts.setdefault(index, []).append(message)
            else:
                replies[index] = _joined(parts.pop(index) + [message]) if index in parts else message
        return replies

    def exchange(self, requests: Mapping[int, Message], *, timeout: float | None = None
                 ) -> Iterator[tuple[int, Message, bool]]:
        """:meth:`call`, yielding each reply as it arrives instead: ``(shard index, message, last)``
        for each part of a reply that comes in parts (``last`` on the last one, which alone has the
        status), so the caller uses the values while other shards, or the next part, are still on the
        wire. Refusals are raised as ``RemoteError`` once every reply has arrived. A generator:
        nothing is sent until it is iterated, and the call ends when it is exhausted.

        Every request is started before any is finished, so the shards start working together (a
        blocking send per shard made the last shard wait for the others' bytes); then the transport
        is done with their arrays before any reply is yielded, so a reply is never copied into memory
        that a request still reads (a gradient may be a view of a variable).
        """
        timeout = self.timeout if timeout is None else timeout
        started = self.transport.recorder.now()
        with self._lock:
            ids: dict[int, int] = {}
            handles: list = []
            index = None
            try:
                for index, message in requests.items():
                    self._next_id += 1
                    ids[index] = message.meta["id"] = self._next_id
                    # A shard not reached yet (this task just started) may be gone with a finished job.
                    handles.append((index, job_state.wait_for_peer(
                        partial(self.transport.send_async, self.shards[index], REQUEST_TAG, message),
                        timeout, task=self.transport.task, what=f"parameter-server shard {self.shards[index]}")))
                for index, handle in handles:
                    handle.wait(timeout)
            except (PeerLostError, TransportTimeout) as exc:
                self._settle(handles, timeout)   # the caller may change its arrays once we raise
                raise self._unreachable(index, exc) from None
            except BaseException:
                self._settle(handles, timeout)
                raise
            received = yield from self._gather(ids, timeout)
        op = next((str(m.meta.get("op")) for m in requests.values()), "call")
        self.transport.recorder.record("ps", "set_optimizer" if op == "optimizer" else op, started,
                                       self._describe, requests, received)

    def _describe(self, requests: Mapping[int, Message], received: int) -> dict:
        """One round on the timeline (named by its operation: push, pull...): the bytes and shards."""
        return {"bytes_sent": sum(m.nbytes for m in requests.values()),
                "bytes_received": received,
                "peers": [str(self.shards[index]) for index in requests]}

    @staticmethod
    def _settle(handles: list, timeout: float | None) -> None:
        """Wait for the sends of a failing call (best effort)."""
        for _, handle in handles:
            try:
                handle.wait(timeout)
            except CommunicationError:
                pass

    def _unreachable(self, index: int, exc: Exception) -> Exception:
        """An error sending to shard ``index``, naming the shard and the pieces it holds."""
        if isinstance(exc, PeerLostError):
            return self._lost(index, exc)
        return TransportTimeout(f"parameter-server shard {self.shards[index]}{self._holding(index)} "
                                f"cannot be reached: {exc}")

    def _gather(self, ids: dict[int, int], timeout: float | None):
        """Yield ``(index, message, last)`` for each successful reply (part) as it arrives; then raise
        the refusals; return the bytes received."""
        by_task = {self.shards[index]: index for index in ids}
        done: set[int] = set()
        errors: dict[int, str] = {}
        culprits: list[str] = []    # the task a refusing shard says failed the job
        received = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        # The timeline charges the time until each reply to the shard it came from (the receives here
        # take any shard's reply, so the mailbox cannot name the peer waited on).
        recorder = self.transport.recorder
        waiting_since = recorder.now()
        while len(done) < len(ids):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                waiting = [str(self.shards[i]) for i in ids if i not in done]
                job_state.leave_if_finished(self.transport.task, f"no reply from {', '.join(waiting)}")
                raise TransportTimeout(
                    f"{self.transport.task}: no reply from parameter-server shard(s) {', '.join(waiting)} "
                    f"within {timeout:g} s (are they running? raise timeout= for slow steps)"
                )
            try:
                wait = WAIT_SLICE if remaining is None else min(WAIT_SLICE, remaining)
                reply = self.transport.recv(None, REPLY_TAG, timeout=wait)
            except TransportTimeout:
                self._check_lost(ids, done)
                if self.interrupt is not None:
                    self.interrupt(False)
                continue
            waiting_since = recorder.wait_until_now(reply.src, REPLY_TAG, waiting_since)
            index = by_task.get(reply.src)
            if index is None or reply.meta.get("id") != ids[index]:
                # the late reply to an earlier call that timed out (its shard may wait for the word)
                if reply.meta.get("turn") and reply.meta.get("part", 0) + 1 >= reply.meta.get("parts", 1):
                    self._received(reply.src, reply.meta.get("id"))
                continue
            received += reply.nbytes
            if "error" in reply.meta:
                errors[index] = reply.meta["error"]
                if reply.meta.get("culprit"):
                    culprits.append(str(reply.meta["culprit"]))
                done.add(index)
            else:
                last = reply.meta.get("part", 0) + 1 >= reply.meta.get("parts", 1)
                if last:
                    done.add(index)
                    if reply.meta.get("turn"):
                        self._received(reply.src, reply.meta.get("id"))
                    if "status" in reply.meta:    # a push's acknowledgement
                        self.acks[index][reply.meta["status"]] += 1
                yield index, reply, last
                waiting_since = recorder.now()   # using the values was not waiting
            self._check_lost(ids, done)
        if errors:
            raise RemoteError("; ".join(f"{self.shards[i]}: {errors[i]}" for i in sorted(errors)),
                              culprit=culprits[0] if culprits else None)
        return received

    def _received(self, shard: TaskId, request_id) -> None:
        """Tell ``shard`` its reply to ``request_id`` is in: the next reply's turn there."""
        try:
            self.transport.send(shard, REQUEST_TAG, Message({"op": "received", "id": request_id}),
                                timeout=self.timeout)
        except CommunicationError:
            pass    # the shard is gone (a later call says so) or slow: its patience ends the turn

    def _check_lost(self, ids, done) -> None:
        lost = self.transport.lost_peers()
        for index in ids:
            if index not in done and self.shards[index] in lost:
                raise self._lost(index, PeerLostError(self.shards[index], lost[self.shards[index]]))

    def check_shards(self) -> None:
        """Raise :class:`~stratagem.ps_service.protocol.ShardLostError` if a shard is known to be gone (outside a
        call: a worker waiting for its next step, the coordinator's ``join()``)."""
        self._check_lost(range(self.num_shards), ())

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

    def push(self, requests: Mapping[int, PushRequest]) -> Iterator[tuple[int, Message, bool]]:
        """Send each shard its :class:`~stratagem.ps_service.messages.PushRequest`: :meth:`exchange`, whose
        last part of each shard's answer is the acknowledgement
        (:meth:`PushReply.from_meta <stratagem.ps_service.messages.PushReply.from_meta>`), the earlier ones
        the values of a ``pull``. Counts the acknowledgements in ``acks``."""
        return self.exchange({index: request.to_message() for index, request in requests.items()})

    def push_all(self, requests: Mapping[int, PushRequest]) -> dict[int, PushReply]:
        """:meth:`push`, to the end: each shard's acknowledgement (the values sent back left unused)."""
        return {index: PushReply.from_meta(message.meta) for index, message, last in self.push(requests) if last}

    def idle(self, tasks: Sequence[str], idle: bool) -> None:
        """Tell every shard that pushers ``tasks`` have nothing to run (``idle``), or have again."""
        self.broadcast({"op": "idle", "tasks": list(tasks), "idle": idle})

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
