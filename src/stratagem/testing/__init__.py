"""Test support that third-party plugins can reuse: world factories, the transport contract suite, and
the compressor contract suite (:mod:`stratagem.testing.compressor_contract`:
``run_compressor_contract("mycompressor")``).

    from stratagem.testing.contract import TransportContract

    class TestMyTransport(TransportContract):
        transport = "mytransport"

or, for every registered transport (an MPI-launched one gets the suite run inside ``mpiexec`` jobs)::

    from stratagem.testing import run_contract
    TestContract_zmq = run_contract("zmq")

A transport that reads bytes from the network also gets the byte-stream contract (hostile peers,
restarts: :mod:`stratagem.testing.byte_stream`) when given a way to open a raw peer to an endpoint::

    from stratagem.testing.raw_peers import ZmqRawPeer
    TestContract_zmq = run_contract("zmq", raw_peer=ZmqRawPeer.to)
"""

from __future__ import annotations


def run_contract(transport: str, raw_peer=None, **attributes) -> type:
    """Make a ``TransportContract`` test class for ``transport`` (for dynamic parametrisation).

    A transport whose endpoints are ranks of an MPI job (its class says ``launcher = "mpiexec"``) gets
    :class:`~stratagem.testing.mpi_contract.MpiTransportContract`: the same tests, run inside one.
    With ``raw_peer`` (a function of a started endpoint that returns a
    :class:`~stratagem.testing.byte_stream.RawPeer` connected to it) it gets
    :class:`~stratagem.testing.byte_stream.ByteStreamContract`: those tests and the byte-stream ones.
    ``attributes`` set the suite's class attributes (``options``, ``tells_the_sender_of_a_refusal``).
    """
    from stratagem.core.errors import PluginError
    from stratagem.plugins.manager import plugin_manager

    from stratagem.testing.contract import TransportContract

    base: type = TransportContract
    try:
        launcher = getattr(plugin_manager().transport_class(transport), "launcher", None)
    except PluginError:
        launcher = None
    if raw_peer is not None:
        from stratagem.testing.byte_stream import ByteStreamContract

        base = ByteStreamContract
        attributes["open_raw"] = staticmethod(raw_peer)
    elif launcher == "mpiexec":
        from stratagem.testing.mpi_contract import MpiTransportContract

        base = MpiTransportContract
    return type(f"TestContract_{transport}", (base,), {"transport": transport, **attributes})
