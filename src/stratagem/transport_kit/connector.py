"""The connecting side of the connection handshake, as a state machine that does no I/O.

The counterpart of :mod:`stratagem.transport_kit.acceptor`: every socket transport (zmq, grpc, and shm's zmq
control connections) opens a connection to a peer's address the same way (README: "Security")::

    connector                                   acceptor
      HELLO ->
                                             <- WELCOME                     (no cluster secret)
                                             <- CHALLENGE                   (with a secret)
      AUTH  ->
                                             <- WELCOME
                                             <- REJECT {reason}             (at any point: refused)

A transport makes one :class:`Connector` per connection, sends :attr:`Connector.hello` as its HELLO,
feeds :meth:`Connector.on_frame` each decoded frame that comes back (:meth:`Connector.malformed` for
one it could not decode) and carries out the actions returned, in order: :class:`Send` (a control
frame to send on the same connection), :data:`READY` (the handshake is complete: data may flow),
:class:`Failed` (the connection is over: send its ``reject``, if any, as a REJECT; every send to the
peer raises its ``error``) and :data:`GOODBYE` (after READY: the peer closed its transport).

The rules, the same on every transport:

- an answer must come from the task we connected to: a CHALLENGE or WELCOME that names another task
  means the cluster specs differ (that task serves the address), a :class:`ConfigurationError`
  naming both and the address;
- a CHALLENGE must answer our own HELLO (its nonce and our task), come only to a task that has a
  secret, and only once; its proof of the secret must check (else an ``AuthenticationError``, and a
  REJECT tells the acceptor why);
- with a secret, a WELCOME counts only after our AUTH: an acceptor that welcomes us unchallenged has
  not proved it knows the secret;
- anything else (a second WELCOME, a HELLO, AUTH or DATA, a GOODBYE before the WELCOME, a frame that
  does not decode) is a :class:`ProtocolError`, never ignored.

    >>> from stratagem.core.cluster import ClusterSpec, TaskId
    >>> from stratagem.transport_kit.acceptor import Acceptor, Reply
    >>> cluster = ClusterSpec({"worker": ["h:1", "h:2"]})
    >>> a, b = TaskId("worker", 0), TaskId("worker", 1)
    >>> acceptor = Acceptor(b, cluster, secret=b"k")
    >>> conn, _ = acceptor.connect("h:1")
    >>> connector = Connector(a, b, cluster.cluster_id, secret=b"k", address="h:2")
    >>> [challenge] = acceptor.on_frame(conn, Kind.HELLO, connector.hello)
    >>> [auth] = connector.on_frame(challenge.kind, challenge.meta)
    >>> auth.kind.name
    'AUTH'
    >>> _, welcome = acceptor.on_frame(conn, auth.kind, auth.meta)
    >>> connector.on_frame(welcome.kind, welcome.meta)
    [READY]
    >>> wrong = Connector(a, TaskId("worker", 3), cluster.cluster_id, secret=None, address="h:2")
    >>> wrong.on_frame(Kind.WELCOME, {"task": "worker:1"})[0].error
    ConfigurationError('the address h:2 of /job:worker/task:3 is served by /job:worker/task:1: give every task the same cluster spec')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from stratagem.transport_kit import handshake
from stratagem.core.cluster import TaskId
from stratagem.core.errors import AuthenticationError, ConfigurationError, ProtocolError
from stratagem.core.wire import Kind

_FIX_SECRET = "give every task the same STRATAGEM_SECRET"


class Stage(enum.Enum):
    """Where an outgoing connection stands."""

    HELLO = "HELLO sent, waiting for WELCOME or CHALLENGE"
    AUTH = "AUTH sent, waiting for WELCOME"
    OPEN = "open"
    FAILED = "failed"


# -- actions -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Send:
    """Send this control frame on the connection."""

    kind: Kind
    meta: dict


@dataclass(frozen=True)
class Failed:
    """The connection is over: every send to the peer raises ``error``. With a ``reject`` (the
    acceptor waits for our AUTH), send it as a REJECT first, so the acceptor logs why; ``by_peer``:
    the acceptor refused us (its REJECT), and ends the connection itself."""

    error: Exception
    reject: dict | None = None
    by_peer: bool = False


class _Signal:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: The handshake is complete: data may flow.
READY = _Signal("READY")
#: The peer of an open connection said GOODBYE (it closed its transport).
GOODBYE = _Signal("GOODBYE")


# -- the machine -------------------------------------------------------------------------------------

class Connector:
    """The handshake of one connection from ``task`` to ``peer`` (see the module doc).

    Args:
        task: this task (the connector).
        peer: the task we connect to; every answer must come from it.
        cluster_id: the cluster's id (the HELLO carries it, the proofs bind it).
        secret: the cluster secret, or None.
        address: where ``peer`` is reached (for messages only).
    """

    __slots__ = ("task", "peer", "cluster_id", "secret", "address", "hello", "nonce", "stage", "accepted",
                 "error")

    def __init__(self, task: TaskId, peer: TaskId, cluster_id: str, secret: bytes | None, address: str = ""):
        self.task, self.peer, self.cluster_id, self.secret = task, peer, cluster_id, secret
        self.address = address
        #: The HELLO's metadata: the transport sends it first.
        self.hello, self.nonce = handshake.make_hello(task, cluster_id, secret)
        self.stage = Stage.HELLO
        #: True once welcomed, whatever happened since.
        self.accepted = False
        #: Why the connection failed (None while it has not).
        self.error: Exception | None = None

    @property
    def open(self) -> bool:
        """True while data may flow (welcomed, and not failed since)."""
        return self.stage is Stage.OPEN

    @property
    def handshaking(self) -> bool:
        """True until welcomed or failed."""
        return self.stage in (Stage.HELLO, Stage.AUTH)

    @property
    def token(self) -> bytes | None:
        """What this connection shows at the peer's connection gate, if the transport has one
        (:func:`~stratagem.transport_kit.handshake.connection_token`; None without a secret)."""
        return None if self.secret is None else handshake.connection_token(self.secret, self.cluster_id)

    def _where(self) -> str:
        return f"{self.peer} at {self.address}" if self.address else str(self.peer)

    # -- what a transport tells ----------------------------------------------------------------------
    def on_frame(self, kind: Kind, meta: dict) -> list:
        """A frame of ``kind`` with metadata ``meta`` came back on the connection."""
        if self.stage is Stage.FAILED:
            return []
        if not isinstance(meta, dict):
            meta = {}
        if kind == Kind.REJECT:
            return self._on_reject(meta)
        if kind == Kind.CHALLENGE:
            return self._on_challenge(meta)
        if kind == Kind.WELCOME:
            return self._on_welcome(meta)
        if kind == Kind.GOODBYE and self.stage is Stage.OPEN:
            return [GOODBYE]
        return self._fail(ProtocolError(f"{self._where()} sent an unexpected {Kind(kind).name} frame "
                                        f"({self.stage.value})"))

    def malformed(self, reason: str) -> list:
        """An answer on the connection could not be decoded (``reason``)."""
        if self.stage is Stage.FAILED:
            return []
        return self._fail(ProtocolError(f"{self._where()} sent a malformed control frame: {reason}"))

    # -- the handshake -------------------------------------------------------------------------------
    def _wrong_task(self, meta: dict) -> Exception | None:
        """The error if ``meta`` names another task than ``peer`` (None if it names ``peer``)."""
        claimed = meta.get("task")
        if claimed == self.peer.short:
            return None
        try:
            other = str(TaskId.parse(claimed)) if isinstance(claimed, str) else repr(claimed)
        except ConfigurationError:
            other = repr(claimed)
        return ConfigurationError(f"the address {self.address or '?'} of {self.peer} is served by {other}: "
                                  f"give every task the same cluster spec")

    def _on_challenge(self, meta: dict) -> list:
        first = self.stage is Stage.HELLO
        reject = first  # the acceptor waits for our AUTH: tell it why
        error = self._wrong_task(meta)
        if error is None and not first:
            error = ProtocolError(f"{self._where()} sent an unexpected CHALLENGE ({self.stage.value})")
        if error is None and self.secret is None:
            error = AuthenticationError(f"{self._where()} challenged this task for a cluster secret, but this "
                                        f"task has none: {_FIX_SECRET}")
        if error is None and (not handshake.answers_hello(meta, self.nonce) or meta.get("to") != self.task.short):
            error = ProtocolError(f"{self._where()} sent a CHALLENGE that does not answer this task's HELLO")
        if error is None:
            try:
                auth = handshake.answer_challenge(self.secret, self.cluster_id, self.task, self.peer, self.nonce, meta)
            except AuthenticationError as exc:
                error = AuthenticationError(f"{exc}; {_FIX_SECRET}")
            except ProtocolError as exc:
                error = exc
            else:
                self.stage = Stage.AUTH
                return [Send(Kind.AUTH, auth)]
        return self._fail(error, reject)

    def _on_welcome(self, meta: dict) -> list:
        error = self._wrong_task(meta)
        if error is None and self.stage is Stage.HELLO and self.secret is not None:
            error = AuthenticationError(f"{self._where()} welcomed this task without proving it knows the cluster "
                                        f"secret (it has none?): {_FIX_SECRET}")
        if error is None and self.stage is not Stage.HELLO and self.stage is not Stage.AUTH:
            error = ProtocolError(f"{self._where()} sent an unexpected WELCOME ({self.stage.value})")
        if error is not None:
            return self._fail(error)
        self.stage = Stage.OPEN
        self.accepted = True
        return [READY]

    def _on_reject(self, meta: dict) -> list:
        reason = meta.get("reason")
        reason = reason if isinstance(reason, str) else "no reason given"
        error_type = AuthenticationError if "secret" in reason.lower() else ProtocolError
        self.stage, self.error = Stage.FAILED, error_type(f"{self.peer} refused the connection: {reason}")
        return [Failed(self.error, by_peer=True)]

    def _fail(self, error: Exception, reject: bool = False) -> list:
        self.stage, self.error = Stage.FAILED, error
        return [Failed(error, {"task": self.task.short, "reason": str(error)} if reject else None)]

    def __repr__(self) -> str:
        return f"<Connector {self.task} -> {self._where()}: {self.stage.value}>"
