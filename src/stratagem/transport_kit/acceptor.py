"""The accepting side of the connection handshake, as a state machine that does no I/O.

Every socket transport accepts connections the same way (README: "Security"): a connection must
first say HELLO (checked by :mod:`stratagem.transport_kit.handshake`: version, cluster, a task of the
cluster that is not this one), then, with a cluster secret, answer a CHALLENGE with a valid AUTH;
only then is it *open* and may carry DATA, until its GOODBYE. Anything else ends the connection
with a REJECT that says why. This module holds that logic once; a transport feeds it what arrives
and carries out what it returns:

- :meth:`Acceptor.connect` when a connection comes in (with a handshake budget, the oldest
  connection still in its handshake may have to give way: :class:`CutOff`);
- :meth:`Acceptor.on_frame` with each decoded frame's kind and metadata;
- :meth:`Acceptor.refuse` when the transport itself finds the connection at fault (a malformed or
  oversized frame), :meth:`Acceptor.expire` when its handshake took too long, and
  :meth:`Acceptor.disconnected` when it went away.

Each returns a list of *actions*, to be carried out in order: :class:`Reply` (send this control frame
back on the same connection, never to the task a HELLO claims to be), :class:`Admitted` (the peer
proved who it is), :class:`Refused` (log and count it; the connection is over), :class:`Dropped`
(a frame on a connection that is over already), :class:`Left` (a GOODBYE), :class:`GaveUp` (the
connector refused *our* proof) and :data:`DELIVER` (a DATA frame on an open connection: file it).
A transport may skip the call for DATA on a connection whose ``open`` is true: that is all the
machine would check.

Which peer is which: a connection is one process's, and a task that is admitted again (a new
connection from it) is counted: :attr:`Connection.epoch` numbers its admissions, :attr:`Admitted.again`
says whether it was admitted before (its old process is gone, or is reconnecting), and
:meth:`Acceptor.current` is its latest admitted connection, so a transport can tell the loss of an
old connection from the loss of the task.

What a connection may send next is in :attr:`Connection.expects` and :attr:`Connection.limits`, so a
transport can refuse a frame from its header, before it reads (or allocates for) the rest: before
it is open, only small control frames (:data:`~stratagem.transport_kit.handshake.CONTROL_LIMITS`).

The machine holds no lock: a transport calls it from one thread at a time (zmq: its reader; grpc:
under its lock, the one that also guards its peers).

    >>> from stratagem.core.cluster import ClusterSpec, TaskId
    >>> from stratagem.transport_kit import handshake
    >>> cluster = ClusterSpec({"worker": ["h:1", "h:2"]})
    >>> acceptor = Acceptor(TaskId("worker", 1), cluster, secret=None)
    >>> conn, _ = acceptor.connect("127.0.0.1:5000")
    >>> hello, _ = handshake.make_hello(TaskId("worker", 0), cluster.cluster_id, None)
    >>> [type(a).__name__ for a in acceptor.on_frame(conn, Kind.HELLO, hello)]
    ['Admitted', 'Reply']
    >>> conn.open, conn.task
    (True, TaskId('/job:worker/task:0'))
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from stratagem.transport_kit import handshake
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.transport_kit.handshake import CONTROL_LIMITS
from stratagem.core.wire import Kind, Limits


class Stage(enum.Enum):
    """Where a connection stands."""

    HELLO = "waiting for HELLO"
    AUTH = "challenged, waiting for AUTH"
    OPEN = "open"
    GONE = "said goodbye"
    REFUSED = "refused"
    CLOSED = "closed during its handshake"


#: What each stage accepts next, and what to say of any other kind.
_EXPECTS = {
    Stage.HELLO: ((Kind.HELLO,), "before the handshake completed (unauthenticated connection)"),
    Stage.AUTH: ((Kind.AUTH, Kind.REJECT), "in answer to CHALLENGE"),
    Stage.OPEN: ((Kind.DATA, Kind.GOODBYE), ""),
    Stage.GONE: ((), "after GOODBYE"),
    Stage.REFUSED: ((), "on a refused connection"),
    Stage.CLOSED: ((), "on a closed connection"),
}


# -- actions -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    """Send this control frame back on the connection the frame came in on."""

    kind: Kind
    meta: dict


@dataclass(frozen=True)
class _OfTask:
    task: TaskId
    epoch: int


@dataclass(frozen=True)
class Admitted(_OfTask):
    """``task`` proved who it is on this connection: its ``epoch``-th admission (``again``: not its first,
    so an older connection of it belongs to a process that is gone or going). A WELCOME follows."""

    again: bool


class Left(_OfTask):
    """The peer of an open connection said GOODBYE: ``task`` (admission ``epoch``) closed its transport."""


@dataclass(frozen=True)
class _Ending:
    reason: str


class Refused(_Ending):
    """The connection is refused for ``reason`` (log and count it); a REJECT saying why precedes it."""


class Dropped(_Ending):
    """A frame came on a connection that is over already: drop it for ``reason`` (log and count it)."""


class GaveUp(_Ending):
    """The connector refused this task's proof (its REJECT, with ``reason``) and ends the connection."""


@dataclass(frozen=True)
class CutOff:
    """The handshake budget is full: ``conn``, the oldest connection still in its handshake, gives
    way to a new one (the transport ends it so that its owner, if a task, tries again)."""

    conn: "Connection"
    reason: str


class _Deliver:
    def __repr__(self) -> str:
        return "DELIVER"


#: A DATA frame on an open connection: file it for the peer (``conn.task``).
DELIVER = _Deliver()


# -- the state ---------------------------------------------------------------------------------------

class Connection:
    """One incoming connection's handshake state (made by :meth:`Acceptor.connect`).

    ``peer`` names where it comes from (an address, a socket's id: for messages only); ``link`` is
    whatever the transport keeps with it (its stream object, for instance).
    """

    __slots__ = ("peer", "link", "stage", "open", "accepted", "task", "nonce_c", "nonce_s", "epoch", "_limits")

    def __init__(self, peer: str, link, limits: Limits):
        self.peer = peer
        self.link = link
        self.stage = Stage.HELLO
        #: True while DATA is accepted (admitted, and neither refused nor gone).
        self.open = False
        #: True once admitted, whatever happened since.
        self.accepted = False
        #: The task its HELLO named (checked); None before.
        self.task: TaskId | None = None
        self.nonce_c = b""
        self.nonce_s = b""
        #: The task's admission this connection is (see :class:`Admitted`); 0 before.
        self.epoch = 0
        self._limits = limits

    def move_to(self, stage: Stage) -> None:
        """Enter ``stage``, ``open`` in step with it: the :class:`Acceptor`'s transitions (a transport
        reads the state, and leaves it to the acceptor)."""
        self.stage = stage
        self.open = stage is Stage.OPEN

    @property
    def handshaking(self) -> bool:
        """True until the connection is admitted, refused or closed."""
        return self.stage in (Stage.HELLO, Stage.AUTH)

    @property
    def refused(self) -> bool:
        return self.stage is Stage.REFUSED

    @property
    def goodbye(self) -> bool:
        return self.stage is Stage.GONE

    @property
    def expects(self) -> tuple[Kind, ...]:
        """The frame kinds accepted next."""
        return _EXPECTS[self.stage][0]

    @property
    def why(self) -> str:
        """What to say of a frame of another kind (``unexpected DATA frame <why>``)."""
        return _EXPECTS[self.stage][1]

    @property
    def limits(self) -> Limits:
        """The limits its next frame is held to: the transport's once open, else the handshake's."""
        return self._limits if self.open else CONTROL_LIMITS

    def describe(self) -> str:
        return f"{self.task} ({self.peer})" if self.task else f"connection {self.peer}"

    def __repr__(self) -> str:
        return f"<Connection {self.describe()}: {self.stage.value}>"


class Acceptor:
    """The handshake of every connection into one task (see the module doc).

    Args:
        task: this task (the acceptor).
        cluster: the cluster; a HELLO must name one of its tasks, other than ``task``.
        secret: the cluster secret, or None (then a HELLO is enough).
        limits: the limits frames of an open connection are held to (the transport's).
        slots: how many connections may be in their handshake at once (None: no budget); one more
            cuts off the oldest.
    """

    def __init__(self, task: TaskId, cluster: ClusterSpec, secret: bytes | None, *, limits: Limits | None = None,
                 slots: int | None = None):
        if slots is not None and slots < 1:
            raise ConfigurationError(f"the handshake budget must be at least 1 connection, got {slots}")
        self.task = task
        self.cluster = cluster
        self.cluster_id = cluster.cluster_id
        self.secret = secret
        self.limits = limits or Limits()
        self.slots = slots
        self._handshaking: dict[Connection, None] = {}   # oldest first
        self._epochs: dict[TaskId, int] = {}
        self._current: dict[TaskId, Connection] = {}

    # -- what a transport asks -----------------------------------------------------------------------
    def epoch(self, task: TaskId) -> int:
        """How many times ``task`` was admitted (0: never)."""
        return self._epochs.get(task, 0)

    def current(self, task: TaskId) -> Connection | None:
        """``task``'s latest admitted connection."""
        return self._current.get(task)

    @property
    def handshaking(self) -> int:
        """Connections in their handshake now."""
        return len(self._handshaking)

    @property
    def token(self) -> bytes | None:
        """What a connection must show at the transport's connection gate, if it has one
        (:func:`~stratagem.transport_kit.handshake.connection_token`; None without a secret)."""
        return None if self.secret is None else handshake.connection_token(self.secret, self.cluster_id)

    # -- what a transport tells ----------------------------------------------------------------------
    def connect(self, peer: str, link=None) -> tuple[Connection, list]:
        """A new connection from ``peer``; returns it and the :class:`CutOff` of the oldest connection
        still in its handshake if the budget is now overdrawn."""
        conn = Connection(peer, link, self.limits)
        self._handshaking[conn] = None
        actions = []
        if self.slots is not None and len(self._handshaking) > self.slots:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            oldest.move_to(Stage.REFUSED)
            actions.append(CutOff(oldest, f"{self.slots} connections are waiting for their handshake; "
                                          f"the oldest gives way"))
        return conn, actions

    def on_frame(self, conn: Connection, kind: Kind, meta: dict | None) -> list:
        """A frame of ``kind`` arrived on ``conn`` (``meta`` need not be decoded for a kind that
        ``conn.expects`` does not hold: it is refused from its kind alone)."""
        if kind not in conn.expects:
            why = conn.why
            return self._refuse(conn, f"unexpected {Kind(kind).name} frame" + (f" {why}" if why else ""))
        if kind == Kind.DATA:
            return [DELIVER]
        if kind == Kind.HELLO:
            return self._on_hello(conn, meta)
        if kind == Kind.AUTH:
            return self._on_auth(conn, meta)
        if kind == Kind.GOODBYE:
            conn.move_to(Stage.GONE)
            return [Left(conn.task, conn.epoch)]
        # REJECT, in answer to our CHALLENGE: the connector found our proof wrong.
        self._handshaking.pop(conn, None)
        conn.move_to(Stage.REFUSED)
        reason = meta.get("reason") if isinstance(meta, dict) else None
        return [GaveUp(reason if isinstance(reason, str) else "no reason given")]

    def refuse(self, conn: Connection, reason: str) -> list:
        """The transport found ``conn`` at fault (``reason``): end it with a REJECT."""
        return self._refuse(conn, reason)

    def expire(self, conn: Connection, seconds: float) -> list:
        """``conn``'s handshake time (``seconds``) is up: refuse it if it is still in its handshake."""
        if not conn.handshaking:
            return []
        return self._refuse(conn, f"no handshake within {seconds:g} s")

    def disconnected(self, conn: Connection) -> None:
        """``conn`` went away. An open one stays as it is (frames it sent before going may still be
        queued on their way to the transport); one in its handshake is over."""
        self._handshaking.pop(conn, None)
        if conn.handshaking:
            conn.move_to(Stage.CLOSED)

    # -- the handshake -------------------------------------------------------------------------------
    def _on_hello(self, conn: Connection, meta: dict) -> list:
        try:
            task = handshake.check_hello(meta, self.cluster_id, self.secret)
            self.cluster.check(task)
            if task == self.task:
                raise ProtocolError(f"{task} is this task itself (two processes run the same task?)")
        except (ProtocolError, ConfigurationError) as exc:
            nonce = meta.get("nonce") if isinstance(meta, dict) else None
            return self._refuse(conn, f"handshake refused: {exc}", nonce if isinstance(nonce, bytes) else None)
        conn.task, conn.nonce_c = task, meta["nonce"]
        if self.secret is None:
            return self._admit(conn)
        challenge, conn.nonce_s = handshake.make_challenge(self.secret, self.cluster_id, task, self.task,
                                                           conn.nonce_c)
        conn.move_to(Stage.AUTH)
        return [Reply(Kind.CHALLENGE, challenge)]

    def _on_auth(self, conn: Connection, meta: dict) -> list:
        try:
            handshake.check_auth(self.secret, self.cluster_id, conn.task, self.task, conn.nonce_c,
                                 conn.nonce_s, meta)
        except ProtocolError as exc:
            return self._refuse(conn, str(exc))
        return self._admit(conn)

    def _admit(self, conn: Connection) -> list:
        task = conn.task
        self._handshaking.pop(conn, None)
        conn.epoch = self._epochs[task] = self._epochs.get(task, 0) + 1
        conn.accepted = True
        conn.move_to(Stage.OPEN)
        self._current[task] = conn
        return [Admitted(task, conn.epoch, conn.epoch > 1), Reply(Kind.WELCOME, {"task": self.task.short})]

    def _refuse(self, conn: Connection, reason: str, nonce: bytes | None = None) -> list:
        if conn.stage in (Stage.REFUSED, Stage.CLOSED):
            return [Dropped(reason)]
        self._handshaking.pop(conn, None)
        conn.move_to(Stage.REFUSED)
        reject = {"task": self.task.short, "reason": reason}
        nonce = nonce or conn.nonce_c
        if nonce:
            reject["nonce"] = nonce  # tells the connector which HELLO this answers
        return [Reply(Kind.REJECT, reject), Refused(reason)]
