"""The ``shm`` transport: tasks on one host exchange messages through shared memory.

Design:

* **Control over zmq.** Every ``shm`` task embeds a :class:`~stratagem.transports.zmq.transport.ZmqTransport`
  on its own cluster address (as ``nccl`` does). It runs the connection handshake (with the cluster
  secret's HMAC challenge-response), watches every peer (a dead process drops its connections at
  once; heartbeats catch a silent one after ``peer_timeout``), says goodbye on close, and carries one
  message per ordered pair: the *announcement* of a ring.
* **Data through rings.** The first message a task sends to a peer opens a ring for that direction
  (:mod:`~stratagem.transports.shm.ring`): an anonymous, sealed memfd, handed to the peer over its
  Unix socket (:mod:`~stratagem.transports.shm.rendezvous`) and announced over the authenticated
  control connection. From then on every message to that peer, small or large, is a wire frame
  copied into the ring; the receiver decodes it into buffers it owns. A frame bigger than the ring
  streams through it: the sender publishes every ``chunk_bytes`` and the receiver copies one piece out
  while the sender copies the next in. Messages sent before the announcement went over zmq, and the
  receiver reads the ring only once the announcement has been handled, so delivery stays ordered per
  (source, destination, tag).
* **Waking up.** Each ring keeps its Unix connection open: after publishing, a side writes one byte to
  it, so the other sleeps in ``poll`` instead of spinning (a Python wake-up costs 50-100 us, a spin
  would take a core from the peer on a small machine), and the kernel ends the connection the moment
  a process dies, however it dies: the survivor sees end-of-file, delivers what was published, and
  raises ``PeerLostError`` naming the task (the zmq control connection reports it too).
* **Who reads.** As in zmq: a ``recv`` that waits reads the rings itself (no thread hand-off); a
  background thread reads when nobody does; a ``send`` waiting for room in a full ring reads too, so
  two tasks that send each other more than a ring holds always make progress. Reading never waits
  for a peer (a half-arrived frame is resumed later), so it cannot deadlock with sending.
* **Receive buffers.** Messages own their buffers; large ones are reused once the receiver has
  dropped every reference to them (:mod:`~stratagem.transports.shm.buffers`), since first-touch page
  faults on fresh memory cost more than the copy out of the ring.
* **Native all-reduce.** All-reduces of ``native_allreduce_bytes`` (8 MiB) and more go through
  per-communicator shared arenas, each segment reduced straight out of the others' memory
  (:mod:`~stratagem.transports.shm.collectives`); smaller ones run core's ring over the rings.
* **No leaks.** The rings have no name: no ``/dev/shm`` entry exists at any time, and the memory goes
  when the last task mapping it unmaps or dies (``kill -9`` included). The Unix sockets are
  *abstract* (no file either). A ring to or from a lost peer is unmapped as soon as the loss is known.
* **Security.** A task maps only a memfd whose token an *authenticated* peer announced, that runs as
  our own user (``SO_PEERCRED``), and that is sealed against shrinking (so the peer cannot make our
  accesses fault). Both ring counters are validated on every read, and every length comes from a wire
  header checked against our limits before allocation, so a hostile or buggy peer can neither make us
  read outside the ring nor allocate more than a frame from the network could; a peer that breaks the
  ring's rules is dropped (``PeerLostError`` with the reason), and the others are served on.
* **One host only.** Every task's address must be an address of this machine (checked at
  construction); across hosts use ``zmq`` or ``grpc``.

    >>> import numpy as np
    >>> from stratagem.core.cluster import ClusterSpec
    >>> from stratagem.core.transport import Message
    >>> from stratagem.testing.world import free_ports
    >>> p0, p1 = free_ports(2)
    >>> cluster = ClusterSpec({"worker": [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]})
    >>> with ShmTransport(cluster, "worker:0") as a, ShmTransport(cluster, "worker:1") as b:
    ...     a.send(b.task, "x", Message({"k": 1}, [np.arange(3.0)]))
    ...     m = b.recv(a.task, "x", timeout=10)
    >>> m.meta, m.buffers[0].tolist()
    ({'k': 1}, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import queue
import select
import socket
import sys
import threading
import time

from stratagem.core import wire
from stratagem.core.cluster import ClusterSpec, TaskId, host_of
from stratagem.core.errors import (ConfigurationError, PeerLostError, PluginError, ProtocolError, TransportClosed,
                           TransportTimeout)
from stratagem.transport_kit.mailbox import Mailbox
from stratagem.transport_kit.reading import SharedReader
from stratagem.core.transport import COMPLETED, Message, SendHandle, Transport
from stratagem.core.wire import Kind
from stratagem.transports.shm.buffers import BufferPool
from stratagem.transports.shm.collectives import NATIVE_MIN_BYTES, ShmCollectives
from stratagem.transports.shm.rendezvous import TOKEN_BYTES, Listener, offer, socket_address
from stratagem.transports.shm.ring import MAX_CAPACITY, MIN_CAPACITY, Region, RingError, RingReader, RingWriter
from stratagem.transports.zmq.transport import ZmqTransport

log = logging.getLogger(__name__)

#: Reserved metadata key of the control messages (user metadata may not use it).
RESERVED_KEY = "__shm__"
_ANNOUNCE_TAG = "shm/ring"
_BACKGROUND_GRACE = 0.005  # the background reader stays away this long after a recv() read
_SEND_POLL = 0.05         # a send waiting for room re-checks for losses and timeouts this often
_OFFER_WAIT = 2.0         # seconds to wait for an announced ring's offer on our socket
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class _Inbox(Mailbox):
    """The shared mailbox of the shm transport and its zmq control transport: ring announcements
    that zmq receives are handed to the transport instead of being filed, and losses retire rings.

    What it tells the transport goes through the callbacks it is given (all called on any thread,
    none blocks): ``announced(src, meta)`` a ring announcement, ``filed()`` a message filed by zmq
    (whoever polls the rings must look), ``defer_loss(task, reason)`` a loss, which returns False if
    the inbox is to file it now, ``replaced(task)`` a new process of a peer admitted, and
    ``lost(task, reason)`` a loss filed."""

    def __init__(self, owner: TaskId, *, traffic, recorder, announced, filed, defer_loss, replaced, lost):
        super().__init__(owner, traffic=traffic, recorder=recorder)
        self._announce, self._filed, self._defer = announced, filed, defer_loss
        self._replaced, self._filed_loss = replaced, lost

    def put(self, src: TaskId, tag: str, message) -> None:
        if RESERVED_KEY in message.meta:
            self._announce(src, message.meta)
        else:
            super().put(src, tag, message)
            # Filed by zmq (a peer on another host, or one whose ring is not announced yet): a recv
            # waiting for it may be the one polling the rings, which would see it only at its next turn.
            self._filed()

    def deliver(self, src: TaskId, tag: str, message) -> None:
        """File a message read from a ring."""
        super().put(src, tag, message)

    def mark_lost(self, task: TaskId, reason: str) -> None:
        # What the peer wrote into its ring before it went is delivered first: the loss is filed
        # once the reader has drained that ring (at once if there is none).
        if not self._defer(task, reason):
            self.lose(task, reason)

    def mark_alive(self, task: TaskId, *, replaced: bool = False) -> None:
        if replaced:
            self._replaced(task)
        super().mark_alive(task, replaced=replaced)

    def lose(self, task: TaskId, reason: str) -> None:
        """File the loss of ``task`` (waiters raise once its messages are consumed); retire our ring to it."""
        super().mark_lost(task, reason)
        self._filed_loss(task, reason)


class _Control(ZmqTransport):
    """The embedded zmq transport, delivering into the shm transport's inbox."""

    def __init__(self, inbox: _Inbox, cluster, task, **options):
        self._inbox = inbox
        super().__init__(cluster, task, **options)

    def _new_mailbox(self) -> _Inbox:
        return self._inbox

    def watch(self, task: TaskId) -> None:
        """Connect to ``task`` (if not yet), so that its death is noticed even before it sends us anything."""
        self._ensure_peer(task)


class _Outgoing:
    """Our ring to one peer."""

    def __init__(self, dst: TaskId, conn: socket.socket, region: Region, chunk_bytes: int):
        self.dst, self.conn, self.region = dst, conn, region
        self.writer = RingWriter(region, chunk_bytes, notify=functools.partial(_ring_bell, conn))
        self.poller = select.poll()
        self.poller.register(conn.fileno(), _POLL_IN)
        self.broken: str | None = None

    def close(self) -> None:
        self.conn.close()
        self.region.close()


class _Incoming:
    """A peer's ring to us."""

    def __init__(self, src: TaskId, conn: socket.socket, region: Region, limits, chunk_bytes: int,
                 buffers: BufferPool):
        self.src, self.conn, self.region = src, conn, region
        self.reader = RingReader(region, limits, notify=functools.partial(_ring_bell, conn), notify_bytes=chunk_bytes,
                                 allocate=buffers.take)
        self.eof = False
        #: A new process of ``src`` was admitted: this ring ends without filing a loss (the admission
        #: counted the old process's, and filing it now would declare the new process lost).
        self.superseded = False

    def close(self) -> None:
        self.conn.close()
        self.region.close()


def _ring_bell(conn: socket.socket) -> None:
    """Tell the other end of a ring that we published (a byte on the ring's Unix connection)."""
    try:
        conn.send(b"\1", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except (BlockingIOError, InterruptedError):
        pass  # full of bytes the peer has not read yet: it will look at the ring anyway
    except OSError:
        pass  # the peer is gone: the end-of-file tells whoever waits on it


def _drain_bell(conn: socket.socket) -> bool:
    """Read the doorbell bytes waiting on ``conn``; False at end of file (the peer is gone)."""
    while True:
        try:
            if not conn.recv(65536, socket.MSG_DONTWAIT):
                return False
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False


class ShmTransport(Transport):
    """Shared-memory transport for tasks on one host (see the module docstring for the design).

    Options:
        ring_bytes: capacity of each ring (one per ordered pair of tasks that talk).
        chunk_bytes: a sender publishes (and a receiver frees) the ring in pieces of this size, so
            that copying in and copying out overlap.
        native_allreduce_bytes: all-reduces of at least this many bytes run through per-communicator
            shared arenas (:mod:`~stratagem.transports.shm.collectives`), smaller ones core's ring
            over the rings; ``None``: always core's. The same on every task.
        control_options: options for the control :class:`ZmqTransport` (``bind_host``...).
        remote: ``None`` (the default): every task must be on this host (refused otherwise);
            ``"zmq"``: a cluster that spans hosts, where peers on this host exchange through the
            rings and the others over the zmq connections the control transport already keeps:
            shared memory chosen automatically wherever it can be used. (This host: the tasks whose
            address this process can bind, i.e. in this network namespace, which the rings' abstract
            Unix sockets need.) The native all-reduce then runs only in communicators whose members
            are all on this host.
        **common: the options every transport takes (``secret``, ``timeout``...), shared with the
            control transport.
    """

    name = "shm"
    elastic = True   # its zmq control connection re-accepts a restarted peer, which announces new rings

    def __init__(self, cluster, task, *, ring_bytes: int = 8 << 20, chunk_bytes: int = 1 << 20,
                 native_allreduce_bytes: int | None = NATIVE_MIN_BYTES, control_options: dict | None = None,
                 remote: str | None = None, **common):
        super().__init__(cluster, task, **common)
        # Until the options pass, nothing is made (the exit hook may end a transport refused here).
        self._started, self.control = False, None
        if not isinstance(ring_bytes, int) or not MIN_CAPACITY <= ring_bytes <= MAX_CAPACITY:
            raise ConfigurationError(f"shm: ring_bytes must be an int between {MIN_CAPACITY} and {MAX_CAPACITY}, "
                                     f"got {ring_bytes!r}")
        if not isinstance(chunk_bytes, int) or not 4096 <= chunk_bytes <= ring_bytes // 2:
            raise ConfigurationError(f"shm: chunk_bytes must be an int between 4096 and ring_bytes/2 "
                                     f"({ring_bytes // 2}), got {chunk_bytes!r}")
        if remote is None:
            check_same_host(self.cluster)
            self.ring_peers = frozenset(self.cluster.tasks())
        elif remote == "zmq":
            self.ring_peers = same_host_tasks(self.cluster)
        else:
            raise ConfigurationError(f"shm: remote must be None (every task on this host) or 'zmq' (tasks on "
                                     f"other hosts over zmq), got {remote!r}")
        self.ring_bytes, self.chunk_bytes = ring_bytes, chunk_bytes
        if native_allreduce_bytes is not None and (isinstance(native_allreduce_bytes, bool)
                                                   or not isinstance(native_allreduce_bytes, int)
                                                   or native_allreduce_bytes < 1):
            raise ConfigurationError(f"shm: native_allreduce_bytes must be an int >= 1 or None, "
                                     f"got {native_allreduce_bytes!r}")
        self._collectives = (None if native_allreduce_bytes is None
                             else ShmCollectives(self, self._take_offer, min_bytes=native_allreduce_bytes))
        self._inbox = _Inbox(self.task, traffic=self.traffic, recorder=self.recorder, announced=self._on_announce,
                             filed=self._poke, defer_loss=self._defer_loss, replaced=self._on_replaced,
                             lost=self._on_lost)
        self.control = _Control(self._inbox, self.cluster, self.task, **common, **(control_options or {}))
        self._address = socket_address(self.cluster.cluster_id, self.task)
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()
        # sending: one lock per peer guards its ring (opening it, writing a frame)
        self._out: dict[TaskId, _Outgoing] = {}
        self._send_locks: dict[TaskId, threading.Lock] = {}
        self._out_lock = threading.Lock()
        # reading: whoever holds the reader's lock reads every incoming ring
        self._reading = SharedReader(f"stratagem-shm-{self.task.short}", self._pump, self._poke,
                                     self._reader_crashed, grace=_BACKGROUND_GRACE,
                                     after_read=self._inbox.notify)  # another waiter may take over reading
        self._buffers = BufferPool(max_bytes=4 * ring_bytes)  # used by the reader lock's holder only
        self._incoming: dict[TaskId, _Incoming] = {}
        self._by_fd: dict[int, _Incoming] = {}
        self._poller = select.poll()
        self._attach: queue.SimpleQueue = queue.SimpleQueue()   # rings announced, not yet read
        self._announced: dict[TaskId, _Incoming] = {}          # the latest ring from each peer
        self._retire: dict[TaskId, tuple[str, _Incoming]] = {}  # lost peers whose ring is to drain
        self._retire_lock = threading.Lock()
        self._wake_r = self._wake_w = -1

    @classmethod
    def check_usable(cls) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            raise PluginError("transport 'shm' needs Linux (memfd_create, abstract Unix sockets) and Python >= 3.9; "
                              "use transport='zmq'")

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        if self._closed:
            raise TransportClosed(f"{self.task}: a closed transport cannot be started again")
        listener = Listener(self._address)
        # The listener and the wake-up pipe are in place before the control transport starts: from
        # then on a peer can complete its handshake and announce a ring (on the control's reader
        # thread), and an announcement that found no listener would be dropped: that peer's ring
        # would never be read, and everything it sends us lost.
        try:
            wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except BaseException:
            listener.close()
            raise
        with self._listener_lock:
            self._listener = listener
        self._wake_r, self._wake_w = wake_r, wake_w
        self._poller.register(wake_r, select.POLLIN)
        try:
            self.control.start()
        except BaseException:
            with self._listener_lock:
                self._listener = None
            listener.close()
            self._poller.unregister(wake_r)
            self._wake_r = self._wake_w = -1
            os.close(wake_r)
            os.close(wake_w)
            raise
        self._started = True
        self._reading.start()

    def _shutdown(self, graceful: bool) -> None:
        if not self._started:
            if self.control is not None:     # None: its options were refused, nothing was made
                self.control.close()
                self._inbox.close("closed before it started")
            return
        self._reading.stop()
        # Everything we sent is in the rings already; the goodbye goes after it (zmq keeps order).
        self.control.close() if graceful else self.control.abort()
        got_reader = self._reading.lock.acquire(timeout=10)
        try:
            for ring in self._incoming.values():
                ring.close()
            self._incoming.clear()
            while not self._attach.empty():
                self._attach.get().close()
            self._buffers.clear()
            with self._listener_lock:
                self._listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
        finally:
            if got_reader:
                self._reading.lock.release()
        if self._collectives is not None:
            self._collectives.close()
        with self._out_lock:
            outgoing = list(self._out.items())
        for dst, ring in outgoing:
            lock = self._send_lock(dst)
            if lock.acquire(timeout=10):  # a sender notices the close within _SEND_POLL
                try:
                    ring.close()
                finally:
                    lock.release()

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise TransportClosed(f"{self.task}: the shm transport is "
                                  f"{'closed' if self._closed else 'not started (call start())'}")

    # -- messaging ---------------------------------------------------------------------------------
    def send(self, dst, tag, msg, timeout=None) -> None:
        self._require_started()
        if RESERVED_KEY in msg.meta:
            raise ConfigurationError(f"shm: metadata key {RESERVED_KEY!r} is reserved")
        dst = self._route(dst, tag, msg, self._inbox)
        if dst is None:
            return
        if dst not in self.ring_peers:   # on another host (remote="zmq"): the control connection carries it
            self.control.send(dst, tag, msg, timeout)
            return
        timeout = self._timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        parts = wire.encode(Kind.DATA, tag, msg.meta, msg.buffers, self.limits)
        lock = self._send_lock(dst)
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TransportTimeout(f"{self.task}: another send to {dst} held the ring for {timeout:g} s")
        try:
            ring = self._out.get(dst)
            if ring is None or ring.broken is not None:
                ring = self._open_ring(dst, deadline, timeout)
            try:
                ring.writer.write(parts, wait=functools.partial(self._wait_for_room, ring, deadline, timeout))
            except BaseException as exc:
                # The frame is cut off: the ring cannot carry anything more. The next send opens a
                # new one, and the receiver drops this one's half frame when that is announced.
                self._drop_outgoing(ring, f"a send failed halfway: {type(exc).__name__}: {exc}")
                if isinstance(exc, RingError):
                    reason = f"{dst} broke the shared-memory ring's rules: {exc}"
                    self._inbox.mark_lost(dst, reason)
                    raise PeerLostError(dst, reason) from None
                raise
            if ring.broken is not None:  # the peer was lost while we wrote: unmap now, not at close
                self._drop_outgoing(ring, ring.broken)
        finally:
            lock.release()

    def send_async(self, dst, tag, msg, timeout=None) -> SendHandle:
        """To a peer on another host (``remote="zmq"``): zmq's own asynchronous send, so a pipelined
        algorithm keeps several messages on the link (a blocking send would leave it idle while this task
        waits for each message to be written out); through a ring, the copy is made before returning."""
        task = TaskId.parse(dst) if dst in self.cluster else None
        if task is None or task in self.ring_peers:
            return super().send_async(dst, tag, msg, timeout)   # a blocking send (or its refusal)
        self._require_started()
        if RESERVED_KEY in msg.meta:
            raise ConfigurationError(f"shm: metadata key {RESERVED_KEY!r} is reserved")
        dst = self._route(dst, tag, msg, self._inbox)
        return COMPLETED if dst is None else self.control.send_async(dst, tag, msg, timeout)

    def recv(self, src, tag, timeout=None) -> Message:
        self._require_started()
        if src is not None:
            src = self._check_peer(src)
            if src != self.task and self._inbox.is_lost(src) is None:
                # Connecting the control transport to the source lets us watch it, so its death
                # wakes us even before it ever sent us anything.
                self.control.watch(src)
        return self._inbox.get(src, tag, self._timeout(timeout), pump=self._reading.for_waiter)

    def flush(self, timeout=None, tasks=None) -> None:
        """What went over zmq (announcements, and with ``remote="zmq"`` every message to another
        host) is written out; what is in a ring is already in the peer's memory."""
        self.control.flush(timeout, tasks)

    def lost_peers(self) -> dict[TaskId, str]:
        return self._inbox.lost()

    def peer_losses(self, task) -> int:
        return self._inbox.losses(TaskId.parse(task))

    def native_collectives(self):
        return {} if self._collectives is None else self._collectives.table()

    # -- sending -----------------------------------------------------------------------------------
    def _send_lock(self, dst: TaskId) -> threading.Lock:
        with self._out_lock:
            lock = self._send_locks.get(dst)
            if lock is None:
                lock = self._send_locks[dst] = threading.Lock()
            return lock

    def _open_ring(self, dst: TaskId, deadline: float | None, timeout: float | None) -> _Outgoing:
        """Make a ring to ``dst``, hand it over and announce it (send lock held)."""
        old = self._out.pop(dst, None)
        if old is not None:
            old.close()
        token = os.urandom(TOKEN_BYTES)
        # The name only shows in /proc/PID/maps (a memfd has no file): cluster, then direction.
        region = Region.create(f"{self.cluster.cluster_id[:8]}:{self.task.short}->{dst.short}", self.ring_bytes)
        conn = None
        try:
            conn = offer(socket_address(self.cluster.cluster_id, dst), token, self.ring_bytes, region.fd,
                         _remaining(deadline), who=str(dst))
            region.close_fd()  # the peer holds it now; our mapping keeps the memory
            conn.setblocking(False)
            # The handshake (and the secret's proof) happens here: an unauthenticated peer never
            # learns the token, so it can never be made to map our ring, and we write nothing first.
            self.control.send(dst, _ANNOUNCE_TAG, Message({RESERVED_KEY: ["ring", token, self.ring_bytes]}),
                              _remaining(deadline))
        except BaseException:
            if conn is not None:
                conn.close()
            region.close()
            raise
        ring = _Outgoing(dst, conn, region, self.chunk_bytes)
        with self._out_lock:
            self._out[dst] = ring
        return ring

    def _wait_for_room(self, ring: _Outgoing, deadline: float | None, timeout: float | None) -> None:
        """The ring to ``ring.dst`` is full: read our own rings meanwhile, then sleep until the peer
        frees some room (its doorbell), a loss, a close or the deadline."""
        if self._closed:
            raise TransportClosed(f"{self.task}: transport closed while sending to {ring.dst}")
        reason = ring.broken or self._inbox.is_lost(ring.dst)
        if reason is not None:
            raise PeerLostError(ring.dst, reason)
        remaining = _remaining(deadline)
        if remaining is not None and remaining <= 0:
            raise TransportTimeout(f"{self.task}: {ring.dst} did not take a message from the shared-memory ring "
                                   f"within {timeout:g} s (is it stuck?)")
        self._reading.read_now()  # never waits for the reader lock
        wait = _SEND_POLL if remaining is None else min(remaining, _SEND_POLL)
        ring.writer.sleeping(True)
        try:
            if ring.writer.free():
                return
            ready = ring.poller.poll(max(1, int(wait * 1000)))
        finally:
            ring.writer.sleeping(False)
        if ready and not _drain_bell(ring.conn):
            reason = (f"the shared-memory channel to {ring.dst} closed (it closed its transport or its process "
                      f"ended) while {self.task} was sending to it")
            self._inbox.mark_lost(ring.dst, reason)
            raise PeerLostError(ring.dst, reason)

    def _drop_outgoing(self, ring: _Outgoing, reason: str) -> None:
        """Forget and unmap our ring to ``ring.dst`` (its send lock held)."""
        ring.broken = ring.broken or reason
        with self._out_lock:
            if self._out.get(ring.dst) is ring:
                del self._out[ring.dst]
        ring.close()

    # -- receiving: announcements (on zmq's reader), then whoever holds the reader lock ---------------
    def _on_announce(self, src: TaskId, meta: dict) -> None:
        """``src`` (authenticated by the control transport) announced a ring: map it."""
        value = meta.get(RESERVED_KEY)
        if not (isinstance(value, list) and len(value) == 3 and value[0] == "ring" and isinstance(value[1], bytes)
                and len(value[1]) == TOKEN_BYTES and isinstance(value[2], int)):
            self._inbox.mark_lost(src, f"{src} sent a malformed shared-memory announcement")
            return
        _, token, capacity = value
        with self._listener_lock:
            if self._closed or self._listener is None:
                return
            taken = self._listener.take(token, _OFFER_WAIT)
        if taken is None:
            self._inbox.mark_lost(src, f"{src} announced a shared-memory ring that never reached our socket "
                                       f"(does another process hold {self.task}'s socket name?)")
            return
        conn, fd, offered = taken
        try:
            if offered != capacity:
                raise RingError(f"the offer says {offered} bytes, the announcement {capacity}")
            region = Region.attach(fd, capacity)
        except (RingError, OSError, ValueError) as exc:
            conn.close()
            self._inbox.mark_lost(src, f"{src} handed over an unusable shared-memory ring: {exc}")
            return
        finally:
            os.close(fd)
        ring = _Incoming(src, conn, region, self.limits, self.chunk_bytes, self._buffers)
        with self._retire_lock:
            self._announced[src] = ring
        self._attach.put(ring)
        self._poke()

    def _take_offer(self, token: bytes, wait: float):
        """``(connection, fd, capacity)`` of the memfd a peer offered on our socket under ``token`` (an
        arena of the native collectives), or None if none came within ``wait`` seconds or we never
        listened."""
        with self._listener_lock:
            return None if self._listener is None else self._listener.take(token, wait)

    def _defer_loss(self, task: TaskId, reason: str) -> bool:
        """If ``task`` has a ring to us, leave its loss to the reader, who files it once the ring is
        drained (any thread; never blocks). False if there is no ring: file the loss now."""
        with self._retire_lock:
            ring = self._announced.get(task)
            if ring is None:
                return False
            self._retire.setdefault(task, (reason, ring))
        self._poke()
        return True

    def _on_replaced(self, task: TaskId) -> None:
        """A new process of ``task`` was admitted before the old one's loss was filed (any thread):
        the old one's ring to us is drained and ends quietly, and our ring to it is retired."""
        with self._retire_lock:
            for ring in (self._announced.get(task), self._retire.get(task, (None, None))[1]):
                if ring is not None:
                    ring.superseded = True
        self._on_lost(task, f"{task} started again as a new process")
        self._poke()

    def _on_lost(self, task: TaskId, reason: str) -> None:
        """A peer is gone (any thread): retire our ring to it and its arenas; never blocks."""
        if self._collectives is not None:
            self._collectives.peer_lost(task)
        with self._out_lock:
            ring = self._out.get(task)
            lock = self._send_locks.get(task)
        if ring is not None:
            ring.broken = ring.broken or reason
            if lock is not None and lock.acquire(blocking=False):
                try:
                    self._drop_outgoing(ring, reason)
                finally:
                    lock.release()
            # else the sender holding it sees ``broken`` within _SEND_POLL and drops it

    def _poke(self) -> None:
        """Wake whoever is polling the rings."""
        try:
            os.write(self._wake_w, b"\1")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed

    def _reader_crashed(self) -> None:
        self._inbox.close("the shm background reader crashed (see the log)")

    def _pump(self, timeout: float) -> None:
        """Deliver what the rings hold; if nothing, wait up to ``timeout`` for a doorbell (reader lock held)."""
        if self._reading.stopping:
            return
        self._sync_rings()
        if self._read_all() or timeout <= 0:
            return
        rings = list(self._incoming.values())
        for ring in rings:
            ring.reader.sleeping(True)
        try:
            if any(_has_data(ring) for ring in rings):
                events = []
            else:
                events = self._poller.poll(max(1, int(timeout * 1000)))
        finally:
            for ring in rings:
                if ring.region.data is not None:
                    ring.reader.sleeping(False)
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
                continue
            ring = self._by_fd.get(fd)
            if ring is not None and not _drain_bell(ring.conn):
                ring.eof = True
        self._sync_rings()
        self._read_all()

    def _sync_rings(self) -> None:
        """Start reading newly announced rings; drain and drop those of lost peers, then file the loss."""
        while not self._attach.empty():
            ring = self._attach.get()
            old = self._incoming.get(ring.src)
            if old is not None:
                # Announced after everything written to the old ring: deliver that, drop a half
                # frame (its send failed).
                self._read(old)
                self._forget_incoming(old)
            self._incoming[ring.src] = ring
            self._by_fd[ring.conn.fileno()] = ring
            self._poller.register(ring.conn.fileno(), _POLL_IN)
        if self._retire:
            with self._retire_lock:
                lost, self._retire = self._retire, {}
            for task, (reason, ring) in lost.items():
                if self._incoming.get(task) is ring:
                    self._read(ring)   # what was published before the loss is still delivered
                    self._forget_incoming(ring)
                    if not ring.superseded:
                        self._inbox.lose(task, reason)
                elif ring.region.data is not None:
                    # A newer ring replaced it (a new incarnation announced itself): the loss is old.
                    ring.close()

    def _forget_incoming(self, ring: _Incoming) -> None:
        with self._retire_lock:
            if self._announced.get(ring.src) is ring:
                del self._announced[ring.src]
        if self._incoming.get(ring.src) is ring:
            del self._incoming[ring.src]
        fd = ring.conn.fileno()
        if self._by_fd.get(fd) is ring:
            del self._by_fd[fd]
            self._poller.unregister(fd)
        ring.close()

    def _read_all(self) -> bool:
        delivered = False
        for ring in list(self._incoming.values()):
            delivered = self._read(ring) or delivered
            if ring.eof and self._incoming.get(ring.src) is ring:
                self._on_eof(ring)
        return delivered

    def _read(self, ring: _Incoming) -> bool:
        """Deliver the frames complete in ``ring``; a peer that broke the rules is dropped."""
        if ring.region.data is None:
            return False
        try:
            frames = ring.reader.poll()
        except (ProtocolError, MemoryError) as exc:
            # The stream cannot be resynchronised past a bad frame (nor one we cannot hold): drop the
            # peer, and keep serving the others.
            what = "broke the shared-memory ring's rules" if isinstance(exc, ProtocolError) else \
                "sent a frame this task cannot allocate"
            log.warning("%s: dropped %s, which %s: %s", self.task, ring.src, what, exc)
            self._forget_incoming(ring)
            self._inbox.lose(ring.src, f"{ring.src} {what}: {type(exc).__name__}: {exc}")
            return False
        for frame in frames:
            self._inbox.deliver(ring.src, frame.tag, Message(frame.meta, frame.buffers, ring.src))
        return bool(frames)

    def _on_eof(self, ring: _Incoming) -> None:
        """The peer's end of the ring closed: everything it published has been delivered above."""
        if ring.reader.partial:
            reason = (f"{ring.src} died while sending a message through shared memory "
                      f"(its ring closed halfway through a frame)")
        else:
            reason = f"{ring.src} closed its shared-memory channel (it closed its transport or its process ended)"
        with self._retire_lock:
            earlier = self._retire.pop(ring.src, None)
        self._forget_incoming(ring)
        if not ring.superseded:
            self._inbox.lose(ring.src, earlier[0] if earlier is not None and earlier[1] is ring else reason)


def _has_data(ring: _Incoming) -> bool:
    """Whether ``ring`` has bytes to read (or a broken counter, which reading will report)."""
    try:
        return ring.reader.available() > 0
    except ProtocolError:
        return True


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# -- one host only ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _is_local_host(host: str) -> bool | None:
    """True if ``host`` names this machine, False if not, None if it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
                return True
        except ValueError:
            continue
        probe = socket.socket(family, socket.SOCK_STREAM)
        try:
            probe.bind((sockaddr[0], 0, *sockaddr[2:]))  # only an address of this machine binds
            return True
        except OSError:
            continue
        finally:
            probe.close()
    return False


def _task_is_local(cluster: ClusterSpec, task: TaskId) -> bool:
    """Whether ``task``'s address is on this host (``ConfigurationError`` if it has none or does not resolve)."""
    address = cluster.address(task)
    if address is None:
        raise ConfigurationError(f"{task} has no network address (the cluster came from an MPI world): "
                                 f"transport 'shm' needs addresses for its control connections")
    host = host_of(address)
    local = _is_local_host(host)
    if local is None:
        raise ConfigurationError(f"transport 'shm': cannot resolve {task}'s host {host!r}")
    return local


def check_same_host(cluster: ClusterSpec) -> None:
    """Raise ``ConfigurationError`` unless every task of ``cluster`` has an address on this machine."""
    for task in cluster.tasks():
        if not _task_is_local(cluster, task):
            raise ConfigurationError(
                f"transport 'shm' connects only tasks on one host, but {task} is at {cluster.address(task)}, which "
                f"is not an address of this machine; use transport_options={{'remote': 'zmq'}} (shared memory "
                f"between the tasks on each host, zmq between hosts), or transport='zmq' or 'grpc'")


def same_host_tasks(cluster: ClusterSpec) -> frozenset:
    """The tasks of ``cluster`` whose address is on this machine (ourselves included)."""
    return frozenset(task for task in cluster.tasks() if _task_is_local(cluster, task))
