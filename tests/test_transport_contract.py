"""Every built-in transport usable on this machine against the one contract suite.

The suite lives in ``stratagem.testing.contract`` so that third-party transports run the very same
tests; here one test class is made per registered built-in transport. The transports that read bytes
from the network (zmq, grpc) also run the byte-stream suite (``stratagem.testing.byte_stream``:
hostile peers, restarts), each with its raw peer from ``stratagem.testing.raw_peers``.
"""

from stratagem.plugins.manager import plugin_manager
from stratagem.testing import run_contract
from stratagem.testing.byte_stream import ByteStreamContract
from stratagem.testing.raw_peers import GrpcRawPeer, ZmqRawPeer

#: How each byte-stream transport's raw peer is opened, and what else its suite must know.
BYTE_STREAMS = {
    "zmq": {"raw_peer": ZmqRawPeer.to},
    "grpc": {"raw_peer": GrpcRawPeer.to, "tells_the_sender_of_a_refusal": True},
}

for _info in plugin_manager().describe(check=True):
    if _info.kind == "transport" and _info.source == "builtin" and _info.usable:
        globals()[f"TestContract_{_info.name}"] = run_contract(_info.name, **BYTE_STREAMS.get(_info.name, {}))


def test_the_built_in_transports_are_all_under_contract():
    names = {name[len("TestContract_"):] for name in globals() if name.startswith("TestContract_")}
    assert {"local", "zmq"} <= names
    byte_streams = {name for name in names if issubclass(globals()[f"TestContract_{name}"], ByteStreamContract)}
    assert byte_streams == set(BYTE_STREAMS) & names and "zmq" in byte_streams
