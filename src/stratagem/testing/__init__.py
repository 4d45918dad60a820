"""Test support that third-party plugins can reuse: world factories and the transport contract suite.

    from stratagem.testing.contract import TransportContract

    class TestMyTransport(TransportContract):
        transport = "mytransport"

or, for every registered transport (an MPI-launched one gets the suite run inside ``mpiexec`` jobs)::

    from stratagem.testing import run_contract
    TestContract_zmq = run_contract("zmq")
"""

from __future__ import annotations


def run_contract(transport: str) -> type:
    """Make a ``TransportContract`` test class for ``transport`` (for dynamic parametrisation).

    A transport whose endpoints are ranks of an MPI job (its class says ``launcher = "mpiexec"``) gets
    :class:`~stratagem.testing.mpi_contract.MpiTransportContract`: the same tests, run inside one.
    """
    from stratagem.core.errors import PluginError
    from stratagem.plugins.manager import plugin_manager

    from stratagem.testing.contract import TransportContract

    base: type = TransportContract
    try:
        launcher = getattr(plugin_manager().transport_class(transport), "launcher", None)
    except PluginError:
        launcher = None
    if launcher == "mpiexec":
        from stratagem.testing.mpi_contract import MpiTransportContract

        base = MpiTransportContract
    return type(f"TestContract_{transport}", (base,), {"transport": transport})
