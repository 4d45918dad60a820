"""The ``local`` transport: several tasks of one world inside one process.

For single-process multi-replica work and fast tests. Endpoints find each other through a shared
:class:`LocalFabric` passed as the ``fabric`` option (``LocalTransport.world_options()`` makes one).
Sends copy the buffers, so the sender may reuse them at once, as with any other transport.

    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.core.transport import Message
    >>> cluster = ClusterSpec({"worker": ["local:0", "local:1"]})
    >>> fabric = LocalFabric()
    >>> a = LocalTransport(cluster, "worker:0", fabric=fabric); a.start()
    >>> b = LocalTransport(cluster, "worker:1", fabric=fabric); b.start()
    >>> a.send(b.task, "ping", Message({"n": 1}))
    >>> b.recv(None, "ping", timeout=1).meta
    {'n': 1}
    >>> a.close(); b.close()
"""

from __future__ import annotations

import threading

from stratagem.core.failures import said_goodbye
from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError, PeerLostError, TransportClosed
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.core.transport import Message, Transport


class LocalFabric:
    """The in-process 'network': one mailbox per task, shared by the endpoints of one world."""

    def __init__(self):
        self._lock = threading.Lock()
        self._mailboxes: dict[TaskId, Mailbox] = {}
        self._gone: dict[TaskId, str] = {}
        self._running: set[TaskId] = set()

    def mailbox(self, task: TaskId) -> Mailbox:
        with self._lock:
            box = self._mailboxes.get(task)
            if box is None:
                box = self._mailboxes[task] = Mailbox(task)
            return box

    def join(self, task: TaskId) -> Mailbox:
        with self._lock:
            if task in self._running:
                raise ConfigurationError(f"{task} is already running on this local fabric")
            self._running.add(task)
            self._gone.pop(task, None)
            box = self._mailboxes.get(task)
            if box is None:  # messages sent before this endpoint started wait in an early mailbox
                box = self._mailboxes[task] = Mailbox(task)
            peers = list(self._mailboxes.items())
        for other, other_box in peers:
            if other != task:
                other_box.mark_alive(task)
        return box

    def leave(self, task: TaskId, reason: str) -> None:
        with self._lock:
            self._gone[task] = reason
            self._running.discard(task)
            box = self._mailboxes.pop(task, None)
            peers = list(self._mailboxes.values())
        if box is not None:
            box.close(reason)
        for other_box in peers:
            other_box.mark_lost(task, reason)

    def gone(self, task: TaskId) -> str | None:
        with self._lock:
            return self._gone.get(task)


class LocalTransport(Transport):
    """In-process transport; every endpoint of a world shares one ``fabric``."""

    name = "local"
    elastic = True   # a restarted peer is re-accepted (LocalFabric.join marks it alive)
    in_process = True
    device_buffers = True  # buffers are copied with their own array module, so cupy stays on device

    def __init__(self, cluster, task, *, fabric: LocalFabric | None = None, **common):
        super().__init__(cluster, task, **common)
        if fabric is None:
            raise ConfigurationError(
                "the local transport needs a shared fabric: pass fabric=LocalFabric() (the same one to "
                "every endpoint of the world), e.g. **LocalTransport.world_options()"
            )
        self.fabric = fabric
        self._mailbox: Mailbox | None = None

    @classmethod
    def world_options(cls) -> dict:
        return {"fabric": LocalFabric()}

    def start(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
        if self._mailbox is None:
            self._mailbox = self.fabric.join(self.task)
            self._mailbox.traffic = self.traffic
            self._mailbox.recorder = self.recorder

    def _shutdown(self, graceful: bool) -> None:
        if self._mailbox is not None:
            self._mailbox = None
            self.fabric.leave(self.task, said_goodbye(self.task) if graceful else f"{self.task} died")

    def _box(self) -> Mailbox:
        if self._mailbox is None:
            raise TransportClosed(f"{self.task}: the local transport is not started (call start())")
        return self._mailbox

    def send(self, dst, tag, msg, timeout=None) -> None:
        self._box()
        dst = self._check_peer(dst)
        gone = self.fabric.gone(dst)
        if gone:
            raise PeerLostError(dst, gone)
        # Copy so the sender may reuse its buffers at once, as every transport promises.
        delivered = msg.delivered_copy(self.task)
        if dst != self.task:
            self.traffic.count_sent(dst, msg.nbytes)
        self.fabric.mailbox(dst).put(self.task, tag, delivered)

    def recv(self, src, tag, timeout=None) -> Message:
        box = self._box()
        if src is not None:
            src = self._check_peer(src)
        return box.get(src, tag, self._timeout(timeout))

    def lost_peers(self):
        return self._mailbox.lost() if self._mailbox is not None else {}

    def peer_losses(self, task):
        return self._mailbox.losses(TaskId.parse(task)) if self._mailbox is not None else 0
