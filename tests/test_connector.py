"""The connecting side of the handshake (stratagem.transport_kit.connector): one state machine, the same rules on
every transport.

- Driven directly against the accepting side (stratagem.transport_kit.acceptor): the handshake with and
  without a secret, and every answer it must refuse (another task, a CHALLENGE it did not ask for or
  that answers another HELLO, a bad proof, a WELCOME without the proof, a REJECT, frames out of turn).
- Over real sockets, on zmq, grpc and shm (whose control connections are zmq's): a task connects to
  an address where a raw acceptor (stratagem.testing.raw_peers) answers as the wrong task, with a
  CHALLENGE although there is no secret, with a bad proof or with a WELCOME without one. The send
  raises the error naming the problem and the fix; where the acceptor waits for our AUTH, a REJECT
  tells it why. (zmq, and so shm, used to take the wrong task's WELCOME and to ignore the rest until
  the send timed out.)
"""

from __future__ import annotations

import contextlib

import pytest

from stratagem.transport_kit import handshake
from stratagem.transport_kit.acceptor import Acceptor, Admitted
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.transport_kit.connector import GOODBYE, READY, Connector, Failed, Send, Stage
from stratagem.core.errors import AuthenticationError, ConfigurationError, ProtocolError
from stratagem.core.transport import Message
from stratagem.core.wire import Kind
from stratagem.plugins.manager import plugin_manager
from stratagem.testing.raw_peers import GrpcRawAcceptor, ZmqRawAcceptor
from stratagem.testing.world import local_cluster

pytestmark = pytest.mark.timeout(60)

SECRET = b"cluster secret"
CLUSTER = ClusterSpec({"worker": ["h:1", "h:2", "h:3"]})
ME, PEER, OTHER = CLUSTER.tasks()
CID = CLUSTER.cluster_id


def connector(secret=None) -> Connector:
    return Connector(ME, PEER, CID, secret, address="h:2")


def challenge_for(c: Connector, secret=SECRET, as_task=PEER) -> dict:
    meta, _ = handshake.make_challenge(secret, CID, ME, as_task, c.nonce)
    return meta


def failure(actions) -> Failed:
    assert len(actions) == 1 and isinstance(actions[0], Failed), actions
    return actions[0]


# -- the machine, driven directly --------------------------------------------------------------------

@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_the_handshake_with_the_acceptor_completes(secret):
    acceptor = Acceptor(PEER, CLUSTER, secret)
    conn, _ = acceptor.connect("h:1")
    c = connector(secret)
    assert c.handshaking and not c.open
    answers = acceptor.on_frame(conn, Kind.HELLO, c.hello)
    if secret is not None:
        (challenge,) = answers
        (auth,) = c.on_frame(challenge.kind, challenge.meta)
        assert isinstance(auth, Send) and auth.kind == Kind.AUTH and c.stage is Stage.AUTH
        answers = acceptor.on_frame(conn, auth.kind, auth.meta)
    admitted, welcome = answers
    assert isinstance(admitted, Admitted) and admitted.task == ME
    assert c.on_frame(welcome.kind, welcome.meta) == [READY]
    assert c.open and c.accepted and c.error is None
    assert c.on_frame(Kind.GOODBYE, {}) == [GOODBYE]


def test_a_welcome_from_another_task_names_both_and_the_address():
    c = connector()
    error = failure(c.on_frame(Kind.WELCOME, {"task": OTHER.short})).error
    assert isinstance(error, ConfigurationError)
    assert str(error) == (f"the address h:2 of {PEER} is served by {OTHER}: give every task the same cluster spec")
    assert not c.open and not c.accepted and c.error is error
    assert c.on_frame(Kind.WELCOME, {"task": PEER.short}) == []  # over: nothing more counts


def test_a_challenge_from_another_task_is_refused_even_with_a_valid_proof():
    """The other task knows the secret (it is a task of the cluster, given another spec): its proof is
    valid for itself, yet it is not the task we connected to. The acceptor waits for our AUTH, so a
    REJECT tells it why."""
    c = connector(SECRET)
    refused = failure(c.on_frame(Kind.CHALLENGE, challenge_for(c, as_task=OTHER)))
    assert isinstance(refused.error, ConfigurationError) and f"served by {OTHER}" in str(refused.error)
    assert refused.reject == {"task": ME.short, "reason": str(refused.error)}


def test_a_challenge_without_a_secret_is_refused():
    c = connector()
    refused = failure(c.on_frame(Kind.CHALLENGE, challenge_for(c)))
    assert isinstance(refused.error, AuthenticationError)
    assert "this task has none: give every task the same STRATAGEM_SECRET" in str(refused.error)
    assert refused.reject is not None


def test_a_second_challenge_is_refused():
    c = connector(SECRET)
    (auth,) = c.on_frame(Kind.CHALLENGE, challenge_for(c))
    refused = failure(c.on_frame(Kind.CHALLENGE, challenge_for(c)))
    assert type(refused.error) is ProtocolError and "unexpected CHALLENGE" in str(refused.error)
    assert refused.reject is None  # the acceptor has our AUTH already


@pytest.mark.parametrize("field", ["for", "to"])
def test_a_challenge_that_answers_another_hello_is_refused(field):
    c = connector(SECRET)
    meta = challenge_for(c)
    meta[field] = handshake.make_hello(ME, CID, SECRET)[1] if field == "for" else OTHER.short
    refused = failure(c.on_frame(Kind.CHALLENGE, meta))
    assert type(refused.error) is ProtocolError and "does not answer this task's HELLO" in str(refused.error)


def test_a_bad_proof_is_refused_and_the_acceptor_told():
    c = connector(SECRET)
    refused = failure(c.on_frame(Kind.CHALLENGE, challenge_for(c, secret=b"another secret")))
    assert isinstance(refused.error, AuthenticationError)
    assert "failed the cluster-secret challenge" in str(refused.error) and "STRATAGEM_SECRET" in str(refused.error)
    # The acceptor takes the REJECT as the connector giving up (transport_kit/acceptor.py: GaveUp).
    acceptor = Acceptor(PEER, CLUSTER, b"another secret")
    conn, _ = acceptor.connect("h:1")
    acceptor.on_frame(conn, Kind.HELLO, handshake.make_hello(ME, CID, b"another secret")[0])
    (gave_up,) = acceptor.on_frame(conn, Kind.REJECT, refused.reject)
    assert "secret" in gave_up.reason


def test_a_welcome_without_the_proof_is_refused_with_a_secret():
    c = connector(SECRET)
    error = failure(c.on_frame(Kind.WELCOME, {"task": PEER.short})).error
    assert isinstance(error, AuthenticationError) and "without proving it knows the cluster secret" in str(error)


@pytest.mark.parametrize("reason, error_type", [("no handshake within 1 s", ProtocolError),
                                                ("failed the cluster-secret challenge", AuthenticationError)])
def test_a_reject_ends_the_connection_with_its_reason(reason, error_type):
    c = connector(SECRET)
    refused = failure(c.on_frame(Kind.REJECT, {"task": PEER.short, "reason": reason}))
    assert type(refused.error) is error_type and refused.by_peer and refused.reject is None
    assert str(refused.error) == f"{PEER} refused the connection: {reason}"


@pytest.mark.parametrize("kind", [Kind.HELLO, Kind.AUTH, Kind.DATA, Kind.GOODBYE])
def test_a_frame_out_of_turn_is_refused(kind):
    c = connector()
    error = failure(c.on_frame(kind, {})).error
    assert type(error) is ProtocolError and f"unexpected {kind.name} frame" in str(error)


def test_a_second_welcome_and_a_malformed_answer_are_refused():
    c = connector()
    assert c.on_frame(Kind.WELCOME, {"task": PEER.short}) == [READY]
    assert "unexpected WELCOME" in str(failure(c.on_frame(Kind.WELCOME, {"task": PEER.short})).error)
    c = connector()
    error = failure(c.malformed("bad magic")).error
    assert str(error) == f"{PEER} at h:2 sent a malformed control frame: bad magic"
    assert c.malformed("again") == []


# -- over real sockets: a wrong peer at the address --------------------------------------------------

def _challenge(secret, as_task=None):
    """A responder that answers a HELLO with a CHALLENGE made with ``secret`` as ``as_task``."""
    def respond(kind, meta):
        if kind != Kind.HELLO:
            return []
        connector_task = TaskId.parse(meta["task"])
        challenge, _ = handshake.make_challenge(secret, meta["cluster_id"], connector_task, as_task or meta["peer"],
                                                meta["nonce"])
        return [(Kind.CHALLENGE, challenge)]
    return respond


def _welcome(as_task=None):
    def respond(kind, meta):
        return [(Kind.WELCOME, {"task": (as_task or meta["peer"]).short})] if kind == Kind.HELLO else []
    return respond


#: case: (the connecting task's secret, the raw acceptor's answer, the error, what it says, REJECTed back)
WRONG_PEERS = {
    "welcome-as-another-task": (None, _welcome(TaskId("worker", 2)), ConfigurationError,
                                "served by /job:worker/task:2", False),
    "challenge-as-another-task": (SECRET, _challenge(SECRET, TaskId("worker", 2)), ConfigurationError,
                                  "served by /job:worker/task:2", True),
    "challenge-without-a-secret": (None, _challenge(SECRET), AuthenticationError,
                                   "challenged this task for a cluster secret", True),
    "bad-proof": (SECRET, _challenge(b"another secret"), AuthenticationError,
                  "failed the cluster-secret challenge", True),
    "welcome-without-the-proof": (SECRET, _welcome(), AuthenticationError,
                                  "without proving it knows the cluster secret", False),
}


@contextlib.contextmanager
def _raw_acceptor(transport: str, cluster: ClusterSpec, task: TaskId, respond, secret):
    """A raw acceptor of ``transport`` at ``task``'s address; ``respond`` also learns the cluster id and
    the task it stands in for (as ``meta["cluster_id"]``, ``meta["peer"]``)."""
    def answer(kind, meta):
        return respond(kind, {**meta, "cluster_id": cluster.cluster_id, "peer": task})

    address = cluster.address(task)
    with contextlib.ExitStack() as stack:
        if transport == "grpc":
            raw = stack.enter_context(GrpcRawAcceptor(address, answer))
        else:
            raw = stack.enter_context(ZmqRawAcceptor(address, answer, plain=secret is not None))
        if transport == "shm":  # a ring is offered on the task's Unix socket before the control handshake
            from stratagem.transports.shm.rendezvous import Listener, socket_address

            stack.callback(Listener(socket_address(cluster.cluster_id, task)).close)
        yield raw


@pytest.mark.parametrize("case", sorted(WRONG_PEERS))
@pytest.mark.parametrize("transport", ["zmq", "grpc", "shm"])
def test_a_wrong_peer_at_the_address_is_refused(transport, case):
    secret, respond, error_type, words, rejected = WRONG_PEERS[case]
    cluster = local_cluster(3)
    me, peer = TaskId("worker", 0), TaskId("worker", 1)
    endpoint = plugin_manager().create_transport(transport, cluster=cluster, task=me, timeout=10.0,
                                                 peer_timeout=10.0, secret=secret)
    with _raw_acceptor(transport, cluster, peer, respond, secret) as raw:
        endpoint.start()
        try:
            with pytest.raises(error_type, match=words) as raised:
                endpoint.send(peer, "x", Message({"n": 1}))
            assert str(peer) in str(raised.value)
            with pytest.raises(error_type, match=words):  # and every later send to it
                endpoint.send(peer, "x", Message({"n": 2}))
            assert raw.wait_for(Kind.HELLO, 10) is not None
            reject = raw.wait_for(Kind.REJECT, 10 if rejected else 0.2)
            if rejected:
                assert reject is not None and reject["task"] == me.short and words in reject["reason"], raw.received
            assert not any(kind == Kind.DATA for kind, _ in raw.received), raw.received
        finally:
            endpoint.abort()
