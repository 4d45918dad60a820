"""Handing a ring to a peer: a Unix socket per task, over which memfds travel (``shm`` transport).

Every ``shm`` task listens on an *abstract* Unix socket (Linux: a name with no file behind it, freed
by the kernel when the task dies, so nothing is ever left on disk or in ``/dev/shm``), named after
the cluster id and the task. To open a ring to a peer, the producer connects, checks with
``SO_PEERCRED`` that the listener runs as our own user, and sends an *offer*: magic, a fresh random
token, the ring's capacity, and the memfd itself (``SCM_RIGHTS``). It then announces the token over
its authenticated control connection (zmq, with the cluster secret's handshake); the peer maps an
offered memfd only when an authenticated peer announces its token (:meth:`Listener.take`). Offers
nobody announces are bounded in number and age, then closed unmapped.

The connection stays open for the ring's life: it is each side's doorbell (a byte after publishing,
so the other side can sleep in ``poll`` instead of spinning) and its liveness signal (end of file
the moment the peer's process dies, however it dies).

    >>> import os
    >>> listener = Listener(b"\\0stratagem-shm-doctest-%d" % os.getpid())
    >>> fd = os.memfd_create("doctest")
    >>> conn = offer(listener.address, b"t" * TOKEN_BYTES, 1 << 16, fd, timeout=5)
    >>> peer_conn, got_fd, capacity = listener.take(b"t" * TOKEN_BYTES, timeout=5)
    >>> capacity, os.fstat(got_fd).st_ino == os.fstat(fd).st_ino
    (65536, True)
    >>> for f in (fd, got_fd): os.close(f)
    >>> conn.close(); peer_conn.close(); listener.close()
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import time

from stratagem.core.cluster import TaskId
from stratagem.core.errors import ConfigurationError, ProtocolError, TransportTimeout

log = logging.getLogger("stratagem.transports.shm.transport")

TOKEN_BYTES = 16
_OFFER = struct.Struct("<8sI16sQ")   # magic, version, token, capacity
_MAGIC = b"STRGSHMO"
_VERSION = 1
#: Offers kept while waiting for their announcement, and for how long.
MAX_PENDING = 32
PENDING_SECONDS = 60.0
_CONNECT_RETRY = 0.02


def socket_address(cluster_id: str, task: TaskId) -> bytes:
    """The abstract socket name of ``task`` in the cluster ``cluster_id``."""
    return f"\0stratagem-shm/{cluster_id}/{task.job}/{task.index}".encode()


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def offer(address: bytes, token: bytes, capacity: int, fd: int, timeout: float | None,
          who: str = "the peer") -> socket.socket:
    """Connect to ``address`` (retrying while the peer starts) and offer it the ring ``fd``.

    Returns the connected socket (the ring's doorbell). Raises ``ConfigurationError`` if the socket
    is held by another user, ``TransportTimeout`` if nobody listens within ``timeout``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(address)
            break
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN):
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"{who} does not listen for shared-memory rings (abstract socket "
                    f"{address[1:].decode(errors='replace')!r}) after {timeout:g} s: is it running on this host, "
                    f"in this network namespace, with transport='shm'? Across hosts use transport='zmq' or 'grpc'"
                ) from None
            time.sleep(_CONNECT_RETRY)
    try:
        uid = peer_uid(sock)
        if uid != os.getuid():
            raise ConfigurationError(f"the shared-memory socket of {who} is held by user id {uid}, not by us "
                                     f"({os.getuid()}); refusing to hand it memory")
        socket.send_fds(sock, [_OFFER.pack(_MAGIC, _VERSION, token, capacity)], [fd])
    except BaseException:
        sock.close()
        raise
    return sock


class Listener:
    """This task's abstract Unix socket, and the offers received on it not yet announced."""

    def __init__(self, address: bytes):
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(address)
        except OSError as exc:
            self.sock.close()
            raise ConfigurationError(
                f"cannot listen on the shared-memory socket {address[1:].decode(errors='replace')!r}: {exc} "
                f"(is another process running this task?)") from None
        self.sock.listen(64)
        self.sock.setblocking(False)
        # token -> (connection, fd, capacity, when); connections whose offer has not arrived yet
        self._offers: dict[bytes, tuple[socket.socket, int, int, float]] = {}
        self._waiting: list[tuple[socket.socket, float]] = []

    def take(self, token: bytes, timeout: float) -> tuple[socket.socket, int, int] | None:
        """The connection, memfd and capacity offered with ``token`` (the caller owns them), or None
        if no such offer arrives within ``timeout`` (the offerer sends it before announcing it, so
        a short wait is plenty)."""
        deadline = time.monotonic() + timeout
        while True:
            self._collect()
            found = self._offers.pop(token, None)
            if found is not None:
                return found[:3]
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def _collect(self) -> None:
        """Accept pending connections and read the offers that have arrived (never blocks)."""
        now = time.monotonic()
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # e.g. out of descriptors: try again at the next announcement
                log.warning("shm: cannot accept a ring connection: %s", exc)
                break
            try:
                uid = peer_uid(conn)
            except OSError:
                uid = -1
            if uid != os.getuid():
                log.warning("shm: refused a ring connection from user id %d (not ours)", uid)
                conn.close()
                continue
            conn.setblocking(False)
            self._waiting.append((conn, now))
        still: list[tuple[socket.socket, float]] = []
        for conn, since in self._waiting:
            try:
                self._read_offer(conn, since)
            except BlockingIOError:
                if now - since < PENDING_SECONDS:
                    still.append((conn, since))
                else:
                    conn.close()
            except (OSError, ProtocolError) as exc:
                log.warning("shm: dropped a ring offer: %s", exc)
                conn.close()
        self._waiting = still[-MAX_PENDING:]
        for conn, _ in still[:-MAX_PENDING]:
            conn.close()
        for token, (conn, fd, _, since) in list(self._offers.items()):
            if now - since > PENDING_SECONDS or len(self._offers) > MAX_PENDING:
                del self._offers[token]
                conn.close()
                os.close(fd)

    def _read_offer(self, conn: socket.socket, since: float) -> None:
        data, fds, flags, _ = socket.recv_fds(conn, _OFFER.size, 1, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC)
        if not data and not fds:
            raise ProtocolError("the connection closed before its offer arrived")
        if len(data) != _OFFER.size or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"malformed offer ({len(data)} bytes, {len(fds)} descriptors)")
        magic, version, token, capacity = _OFFER.unpack(data)
        if magic != _MAGIC or version != _VERSION:
            os.close(fds[0])
            raise ProtocolError("an offer with a bad magic or version")
        old = self._offers.pop(token, None)
        if old is not None:
            old[0].close()
            os.close(old[1])
        self._offers[token] = (conn, fds[0], capacity, since)

    def close(self) -> None:
        self.sock.close()
        for conn, _ in self._waiting:
            conn.close()
        for conn, fd, _, _ in self._offers.values():
            conn.close()
            os.close(fd)
        self._waiting, self._offers = [], {}
