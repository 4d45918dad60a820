"""The accepting side of the handshake (stratagem.transport_kit.acceptor), driven directly: no sockets, the frames
a connector would send made with the connector's half of stratagem.transport_kit.handshake. The transports
that feed it (zmq, grpc) are tested over real sockets in their own files."""

from __future__ import annotations

import numpy as np
import pytest

from stratagem.core import wire
from stratagem.transport_kit import handshake
from stratagem.transport_kit.acceptor import (
    DELIVER,
    Acceptor,
    Admitted,
    CutOff,
    Dropped,
    GaveUp,
    Left,
    Refused,
    Reply,
    Stage,
)
from stratagem.core.cluster import ClusterSpec
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.core.wire import Kind, Limits

SECRET = b"cluster secret"
CLUSTER = ClusterSpec({"worker": ["h:1", "h:2", "h:3"]})
ME, PEER, OTHER = CLUSTER.tasks()


def kinds(actions):
    return [a.kind if isinstance(a, Reply) else type(a) for a in actions]


def reply(actions, kind: Kind) -> dict:
    (meta,) = [a.meta for a in actions if isinstance(a, Reply) and a.kind == kind]
    return meta


def refusal(actions) -> str:
    (reason,) = [a.reason for a in actions if isinstance(a, Refused)]
    return reason


class Connector:
    """The honest other end: HELLO, then the AUTH that answers the acceptor's CHALLENGE."""

    def __init__(self, task=PEER, secret=SECRET, cluster_id=CLUSTER.cluster_id, acceptor_task=ME):
        self.task, self.secret, self.cluster_id, self.acceptor_task = task, secret, cluster_id, acceptor_task
        self.hello, self.nonce = handshake.make_hello(task, cluster_id, secret)

    def auth(self, challenge: dict) -> dict:
        return handshake.answer_challenge(self.secret, self.cluster_id, self.task, self.acceptor_task,
                                          self.nonce, challenge)


def admit(acceptor: Acceptor, connector: Connector):
    """A connection through the whole handshake; the connection and the actions of its last step."""
    conn, _ = acceptor.connect("peer")
    actions = acceptor.on_frame(conn, Kind.HELLO, connector.hello)
    if acceptor.secret is not None:
        actions = acceptor.on_frame(conn, Kind.AUTH, connector.auth(reply(actions, Kind.CHALLENGE)))
    return conn, actions


# -- honest connections ------------------------------------------------------------------------------

def test_without_a_secret_a_hello_opens_the_connection():
    acceptor = Acceptor(ME, CLUSTER, None)
    conn, _ = acceptor.connect("127.0.0.1:5000")
    assert conn.expects == (Kind.HELLO,) and not conn.open
    actions = acceptor.on_frame(conn, Kind.HELLO, Connector(secret=None).hello)
    assert kinds(actions) == [Admitted, Kind.WELCOME]
    assert actions[0] == Admitted(PEER, 1, False) and reply(actions, Kind.WELCOME) == {"task": ME.short}
    assert conn.open and conn.task == PEER and conn.expects == (Kind.DATA, Kind.GOODBYE)
    assert acceptor.on_frame(conn, Kind.DATA, {}) == [DELIVER]


def test_with_a_secret_the_connector_must_answer_the_challenge():
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    connector = Connector()
    conn, _ = acceptor.connect("peer")
    actions = acceptor.on_frame(conn, Kind.HELLO, connector.hello)
    assert kinds(actions) == [Kind.CHALLENGE] and not conn.open
    challenge = reply(actions, Kind.CHALLENGE)
    # The challenge proves the acceptor knows the secret, and answers this very HELLO.
    assert challenge["for"] == connector.nonce and challenge["to"] == PEER.short
    assert conn.expects == (Kind.AUTH, Kind.REJECT)
    actions = acceptor.on_frame(conn, Kind.AUTH, connector.auth(challenge))
    assert kinds(actions) == [Admitted, Kind.WELCOME] and conn.open


def test_an_open_connection_takes_the_transports_limits_and_the_handshake_only_tiny_ones():
    limits = Limits(max_payload_bytes=1 << 20)
    acceptor = Acceptor(ME, CLUSTER, SECRET, limits=limits)
    conn, _ = acceptor.connect("peer")
    assert conn.limits == handshake.CONTROL_LIMITS
    connector = Connector()
    actions = acceptor.on_frame(conn, Kind.HELLO, connector.hello)
    assert conn.limits == handshake.CONTROL_LIMITS  # challenged is not admitted
    acceptor.on_frame(conn, Kind.AUTH, connector.auth(reply(actions, Kind.CHALLENGE)))
    assert conn.limits is limits


def test_goodbye_ends_an_open_connection():
    acceptor = Acceptor(ME, CLUSTER, None)
    conn, _ = admit(acceptor, Connector(secret=None))
    assert acceptor.on_frame(conn, Kind.GOODBYE, {}) == [Left(PEER, 1)]
    assert conn.goodbye and not conn.open
    actions = acceptor.on_frame(conn, Kind.DATA, {})
    assert kinds(actions) == [Kind.REJECT, Refused] and "after GOODBYE" in refusal(actions)


# -- hostile connections -----------------------------------------------------------------------------

def test_a_wrong_secret_is_refused_with_a_reject_naming_the_hello():
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    intruder = Connector(secret=b"a guess")
    conn, _ = acceptor.connect("intruder")
    challenge = reply(acceptor.on_frame(conn, Kind.HELLO, intruder.hello), Kind.CHALLENGE)
    # The intruder cannot check our proof (it would fail: the secrets differ); it answers with its own.
    with pytest.raises(ProtocolError, match="secrets differ"):
        intruder.auth(challenge)
    forged = {"task": PEER.short, "mac": handshake._mac(b"a guess", b"connector", CLUSTER.cluster_id, PEER, ME,
                                                         challenge["nonce"], intruder.nonce)}
    actions = acceptor.on_frame(conn, Kind.AUTH, forged)
    assert kinds(actions) == [Kind.REJECT, Refused]
    assert "secrets differ" in refusal(actions) and reply(actions, Kind.REJECT)["nonce"] == intruder.nonce
    assert conn.refused and not conn.open and acceptor.epoch(PEER) == 0
    assert kinds(acceptor.on_frame(conn, Kind.DATA, {})) == [Dropped]  # nothing gets through after that


def test_a_hello_without_the_secret_is_refused_in_a_secret_cluster():
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    conn, _ = acceptor.connect("peer")
    actions = acceptor.on_frame(conn, Kind.HELLO, Connector(secret=None).hello)
    assert kinds(actions) == [Kind.REJECT, Refused] and "STRATAGEM_SECRET" in refusal(actions)


def test_a_replayed_response_is_refused():
    """An AUTH recorded from one connection proves nothing on another: the acceptor's nonce differs."""
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    honest = Connector()
    conn, _ = acceptor.connect("honest")
    challenge = reply(acceptor.on_frame(conn, Kind.HELLO, honest.hello), Kind.CHALLENGE)
    recorded = honest.auth(challenge)
    assert kinds(acceptor.on_frame(conn, Kind.AUTH, recorded)) == [Admitted, Kind.WELCOME]
    # The eavesdropper replays the whole exchange on a connection of its own.
    replay, _ = acceptor.connect("eavesdropper")
    assert kinds(acceptor.on_frame(replay, Kind.HELLO, honest.hello)) == [Kind.CHALLENGE]
    actions = acceptor.on_frame(replay, Kind.AUTH, recorded)
    assert kinds(actions) == [Kind.REJECT, Refused] and "secrets differ" in refusal(actions)
    assert acceptor.epoch(PEER) == 1 and acceptor.current(PEER) is conn
    # Replayed on the connection it came from, once it is open, it is not a handshake frame any more.
    actions = acceptor.on_frame(conn, Kind.AUTH, recorded)
    assert kinds(actions) == [Kind.REJECT, Refused] and "unexpected AUTH frame" in refusal(actions)


def test_an_oversized_hello_is_refused_from_its_header():
    """The handshake's limits: a HELLO too large (or one carrying a buffer) never gets decoded; the
    transport refuses the connection with the decoder's reason."""
    acceptor = Acceptor(ME, CLUSTER, None)
    conn, _ = acceptor.connect("flooder")
    hello = {**Connector(secret=None).hello, "padding": b"x" * (handshake.CONTROL_LIMITS.max_envelope_bytes + 1)}
    with pytest.raises(ProtocolError, match="exceeds the limit") as too_big:
        wire.decode_parts(wire.encode(Kind.HELLO, "", hello), conn.limits)
    with pytest.raises(ProtocolError):
        wire.decode_parts(wire.encode(Kind.HELLO, "", Connector(secret=None).hello, [np.zeros(8)]), conn.limits)
    actions = acceptor.refuse(conn, f"malformed frame: {too_big.value}")
    assert kinds(actions) == [Kind.REJECT, Refused] and conn.refused


@pytest.mark.parametrize("change, says", [
    ({"v": wire.VERSION + 1}, "protocol version"),
    ({"cluster": "another"}, "another cluster"),
    ({"task": "worker:7"}, "worker"),
    ({"task": "worker:0"}, "this task itself"),
    ({"nonce": b"short"}, "nonce"),
    ({"nonce": None}, "nonce"),
], ids=["version", "cluster", "unknown-task", "itself", "nonce-length", "no-nonce"])
def test_a_bad_hello_is_refused_and_the_reject_echoes_only_a_real_nonce(change, says):
    acceptor = Acceptor(ME, CLUSTER, None)
    conn, _ = acceptor.connect("peer")
    hello = {**Connector(secret=None).hello, **change}
    actions = acceptor.on_frame(conn, Kind.HELLO, hello)
    assert kinds(actions) == [Kind.REJECT, Refused] and says in refusal(actions)
    assert refusal(actions).startswith("handshake refused: ")
    reject = reply(actions, Kind.REJECT)
    assert reject["task"] == ME.short and reject["reason"] == refusal(actions)
    assert reject.get("nonce") == (hello["nonce"] if isinstance(hello["nonce"], bytes) else None)
    assert conn.refused and conn.task is None


@pytest.mark.parametrize("kind", [Kind.DATA, Kind.AUTH, Kind.GOODBYE, Kind.WELCOME, Kind.CHALLENGE])
def test_nothing_but_a_hello_opens_a_connection(kind):
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    conn, _ = acceptor.connect("peer")
    actions = acceptor.on_frame(conn, kind, None)  # refused from the kind alone: nothing decoded
    assert kinds(actions) == [Kind.REJECT, Refused]
    assert refusal(actions) == f"unexpected {kind.name} frame before the handshake completed (unauthenticated connection)"


def test_a_second_hello_on_an_open_connection_is_refused():
    acceptor = Acceptor(ME, CLUSTER, None)
    conn, _ = admit(acceptor, Connector(secret=None))
    actions = acceptor.on_frame(conn, Kind.HELLO, Connector(task=OTHER, secret=None).hello)
    assert kinds(actions) == [Kind.REJECT, Refused] and conn.task == PEER and acceptor.epoch(OTHER) == 0


def test_the_handshake_budget_cuts_off_the_oldest_connection_still_in_its_handshake():
    acceptor = Acceptor(ME, CLUSTER, SECRET, slots=2)
    idle, cut = acceptor.connect("idle")
    assert cut == []
    challenged, cut = acceptor.connect("challenged")
    acceptor.on_frame(challenged, Kind.HELLO, Connector(task=OTHER).hello)
    assert cut == [] and acceptor.handshaking == 2
    honest = Connector()
    conn, cut = acceptor.connect("honest")
    assert cut == [CutOff(idle, "2 connections are waiting for their handshake; the oldest gives way")]
    assert idle.refused and kinds(acceptor.on_frame(idle, Kind.HELLO, honest.hello)) == [Dropped]
    # An admitted connection leaves the budget: the next one cuts nothing off.
    challenge = reply(acceptor.on_frame(conn, Kind.HELLO, honest.hello), Kind.CHALLENGE)
    assert kinds(acceptor.on_frame(conn, Kind.AUTH, honest.auth(challenge))) == [Admitted, Kind.WELCOME]
    _, cut = acceptor.connect("next")
    assert cut == [] and acceptor.handshaking == 2


def test_a_connection_that_goes_away_leaves_the_budget():
    acceptor = Acceptor(ME, CLUSTER, None, slots=1)
    gone, _ = acceptor.connect("gone")
    acceptor.disconnected(gone)
    assert gone.stage is Stage.CLOSED and acceptor.handshaking == 0
    assert acceptor.expire(gone, 30) == []
    _, cut = acceptor.connect("next")
    assert cut == []


def test_a_handshake_that_takes_too_long_expires_but_an_admitted_one_does_not():
    acceptor = Acceptor(ME, CLUSTER, None)
    slow, _ = acceptor.connect("slow")
    actions = acceptor.expire(slow, 0.5)
    assert kinds(actions) == [Kind.REJECT, Refused] and refusal(actions) == "no handshake within 0.5 s"
    conn, _ = admit(acceptor, Connector(secret=None))
    assert acceptor.expire(conn, 0.5) == [] and conn.open


def test_the_same_task_admitted_again_is_counted_and_its_latest_connection_is_current():
    """A task that connects again is a new process (or a reconnection): its admissions are numbered,
    so a transport can tell the loss of the old connection from the loss of the task."""
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    first, actions = admit(acceptor, Connector())
    assert actions[0] == Admitted(PEER, 1, again=False)
    second, actions = admit(acceptor, Connector())
    assert actions[0] == Admitted(PEER, 2, again=True)
    assert (first.epoch, second.epoch) == (1, 2) and acceptor.current(PEER) is second
    assert first.open and second.open  # the old one may still carry what it sent before going
    assert acceptor.on_frame(first, Kind.GOODBYE, {}) == [Left(PEER, 1)]
    acceptor.disconnected(second)  # an open connection stays open: its last frames may be queued
    assert second.open and acceptor.epoch(PEER) == 2
    assert acceptor.epoch(OTHER) == 0 and acceptor.current(OTHER) is None


def test_a_connector_that_refuses_our_proof_gives_up():
    acceptor = Acceptor(ME, CLUSTER, SECRET)
    conn, _ = acceptor.connect("peer")
    acceptor.on_frame(conn, Kind.HELLO, Connector().hello)
    assert acceptor.on_frame(conn, Kind.REJECT, {"reason": "the secrets differ"}) == [GaveUp("the secrets differ")]
    assert conn.refused and acceptor.handshaking == 0


def test_the_handshake_budget_is_at_least_one():
    with pytest.raises(ConfigurationError, match="at least 1"):
        Acceptor(ME, CLUSTER, None, slots=0)
