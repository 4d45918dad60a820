"""The ``loopback`` transport: the in-process ``local`` transport with a private fabric by default.

A task of a one-task world can send to itself; endpoints given the same ``fabric`` form a world.
"""

from stratagem.transports.local import LocalFabric, LocalTransport


class LoopbackTransport(LocalTransport):
    name = "loopback"

    def __init__(self, cluster, task, *, fabric=None, **common):
        super().__init__(cluster, task, fabric=LocalFabric() if fabric is None else fabric, **common)
