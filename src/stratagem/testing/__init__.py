"""Test support that third-party plugins can reuse: world factories and the transport contract suite.

    from stratagem.testing.contract import TransportContract

    class TestMyTransport(TransportContract):
        transport = "mytransport"
"""
