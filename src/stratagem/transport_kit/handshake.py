"""The connection handshake every socket transport runs before it accepts data (README: "Security").

A *connector* opens a connection to an *acceptor* and sends HELLO: protocol version, cluster id,
its task and a fresh nonce. Without a cluster secret, the acceptor checks version and cluster id and
accepts. With a secret (``STRATAGEM_SECRET``) both sides prove they know it without sending it, by an
HMAC challenge-response over both nonces, the cluster id and both task names::

    connector                                   acceptor
      HELLO  {v, cluster, task, nonce_c, auth} ->
                                             <- CHALLENGE {task, nonce_s, mac_s = H(k, "acceptor"|...|nonce_c|nonce_s)}
      AUTH   {mac_c = H(k, "connector"|...|nonce_s|nonce_c)} ->

Fresh nonces on both sides defeat replay; binding both task names and the cluster id stops a proof
made for one connection from being used on another. This module holds only the message logic;
transports decide how the frames travel.

    >>> from stratagem.core.cluster import TaskId
    >>> a, b, key = TaskId("worker", 0), TaskId("worker", 1), b"s3cret"
    >>> hello, nonce_c = make_hello(a, "c1", secret=key)
    >>> check_hello(hello, "c1", key)
    TaskId('/job:worker/task:0')
    >>> challenge, nonce_s = make_challenge(key, "c1", a, b, hello["nonce"])
    >>> auth = answer_challenge(key, "c1", a, b, nonce_c, challenge)
    >>> check_auth(key, "c1", a, b, nonce_c, nonce_s, auth)
"""

from __future__ import annotations

import hashlib
import hmac
import os

from stratagem.core.cluster import TaskId
from stratagem.core.errors import AuthenticationError, ConfigurationError, ProtocolError
from stratagem.core.wire import VERSION, Limits

NONCE_BYTES = 16
#: Limits for the frames of the handshake and the other control frames: no buffers, a small envelope.
#: A connection is held to them until it is admitted (see :mod:`stratagem.transport_kit.acceptor`).
CONTROL_LIMITS = Limits(max_envelope_bytes=64 << 10, max_payload_bytes=0, max_buffers=0)


def _mac(secret: bytes, role: bytes, cluster_id: str, connector: TaskId, acceptor: TaskId,
         first: bytes, second: bytes) -> bytes:
    message = b"\x00".join([b"stratagem-v%d" % VERSION, role, cluster_id.encode(),
                            connector.short.encode(), acceptor.short.encode(), first, second])
    return hmac.new(secret, message, hashlib.sha256).digest()


def _field(meta: dict, name: str, kind: type, what: str):
    value = meta.get(name)
    if not isinstance(value, kind):
        raise ProtocolError(f"{what} has no valid {name!r} field")
    return value


def _task(meta: dict, what: str) -> TaskId:
    try:
        return TaskId.parse(_field(meta, "task", str, what))
    except ConfigurationError as exc:
        raise ProtocolError(f"{what}: {exc}") from None


def make_hello(task: TaskId, cluster_id: str, secret: bytes | None) -> tuple[dict, bytes]:
    """The connector's HELLO metadata and the nonce it must remember."""
    nonce = os.urandom(NONCE_BYTES)
    return {"v": VERSION, "cluster": cluster_id, "task": task.short, "nonce": nonce,
            "auth": secret is not None}, nonce


def check_hello(meta: dict, cluster_id: str, secret: bytes | None) -> TaskId:
    """Validate a HELLO; returns the connector's task. Raises ProtocolError/AuthenticationError."""
    version = _field(meta, "v", int, "HELLO")
    if version != VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this task speaks {VERSION}; "
                            f"run the same Stratagem version on every task")
    task = _task(meta, "HELLO")
    peer_cluster = _field(meta, "cluster", str, "HELLO")
    if peer_cluster != cluster_id:
        raise ProtocolError(f"{task} belongs to another cluster (id {peer_cluster}, ours {cluster_id}): "
                            f"every task must be given the same cluster spec")
    nonce = _field(meta, "nonce", bytes, "HELLO")
    if len(nonce) != NONCE_BYTES:
        raise ProtocolError("HELLO nonce has the wrong length")
    wants_auth = _field(meta, "auth", bool, "HELLO")
    if secret is not None and not wants_auth:
        raise AuthenticationError(f"{task} has no cluster secret but this task requires one: "
                                  f"give every task the same STRATAGEM_SECRET")
    if secret is None and wants_auth:
        raise AuthenticationError(f"{task} uses a cluster secret but this task has none: "
                                  f"give every task the same STRATAGEM_SECRET")
    return task


def make_challenge(secret: bytes, cluster_id: str, connector: TaskId, acceptor: TaskId,
                   nonce_c: bytes) -> tuple[dict, bytes]:
    """The acceptor's CHALLENGE metadata and the nonce it must remember."""
    nonce_s = os.urandom(NONCE_BYTES)
    mac = _mac(secret, b"acceptor", cluster_id, connector, acceptor, nonce_c, nonce_s)
    # "for" echoes the connector's nonce so it can tell this challenge answers its own HELLO, and
    # not one that somebody else sent in its name.
    return {"task": acceptor.short, "to": connector.short, "for": nonce_c, "nonce": nonce_s, "mac": mac}, nonce_s


def answers_hello(challenge: dict, nonce_c: bytes) -> bool:
    """True if ``challenge`` answers the HELLO that carried ``nonce_c``."""
    return challenge.get("for") == nonce_c


def answer_challenge(secret: bytes, cluster_id: str, connector: TaskId, acceptor: TaskId,
                     nonce_c: bytes, challenge: dict) -> dict:
    """Check the acceptor's proof; returns the connector's AUTH metadata."""
    nonce_s = _field(challenge, "nonce", bytes, "CHALLENGE")
    mac = _field(challenge, "mac", bytes, "CHALLENGE")
    expected = _mac(secret, b"acceptor", cluster_id, connector, acceptor, nonce_c, nonce_s)
    if not hmac.compare_digest(mac, expected):
        raise AuthenticationError(f"{acceptor} failed the cluster-secret challenge: the secrets differ")
    return {"task": connector.short, "mac": _mac(secret, b"connector", cluster_id, connector, acceptor,
                                                 nonce_s, nonce_c)}


def check_auth(secret: bytes, cluster_id: str, connector: TaskId, acceptor: TaskId, nonce_c: bytes,
               nonce_s: bytes, auth: dict) -> None:
    """Check the connector's proof; raises AuthenticationError if it fails."""
    mac = _field(auth, "mac", bytes, "AUTH")
    expected = _mac(secret, b"connector", cluster_id, connector, acceptor, nonce_s, nonce_c)
    if not hmac.compare_digest(mac, expected):
        raise AuthenticationError(f"{connector} failed the cluster-secret challenge: the secrets differ")


def connection_token(secret: bytes, cluster_id: str) -> bytes:
    """A token derived from the secret (never the secret itself) that a transport may demand before
    it accepts a connection's first byte of data, so that a peer without the secret cannot make it
    buffer anything (the zmq transport uses it as ZMTP PLAIN credentials). It travels in clear: it
    proves nothing by itself, and the challenge-response above still authenticates every peer."""
    return hmac.new(secret, b"stratagem-connection-token\x00" + cluster_id.encode(), hashlib.sha256).hexdigest().encode()
