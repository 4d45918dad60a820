"""The parameter-server service (README: "Parameter servers"): variables held by ``ps`` tasks, updated there.

The service is split by job:

- :mod:`stratagem.core.placement` decides which ps task holds each variable (round-robin, greedy by
  bytes, or explicit ``stratagem.device("/job:ps/task:1")``) and partitions large ones;
- :mod:`stratagem.core.ps_protocol` is the protocol: operations, piece descriptions, errors;
- :mod:`stratagem.core.ps_server` is what a ps task runs: :class:`ParameterServer` (server-side
  optimizer per shard, a global step, versions), with the bookkeeping of the ``sync`` and ``bounded``
  consistency modes in :mod:`stratagem.core.ps_consistency`;
- :mod:`stratagem.core.ps_client` is what workers use: :class:`PSClient`, requests batched per shard
  and sent to all shards concurrently;
- :mod:`stratagem.core.ps_strategy` is what the ``between_graph`` and ``parameter_server`` strategies
  share: remote variables, initialisation by the chief; :mod:`stratagem.core.ps_checkpoint` writes
  and restores their checkpoints;
- :mod:`stratagem.core.ps_coordinator`, :mod:`stratagem.core.ps_worker` and
  :mod:`stratagem.core.ps_functions` are the ``parameter_server`` strategy's scheduling: closures,
  remote values, per-worker datasets, and how functions and values travel.

Everything moves as wire messages (metadata + array buffers) through the transport contract; nothing
is pickled. This module gathers the public names and :func:`serve`.

    >>> from stratagem.core.ps import ParameterServer, PSClient, ShardLostError, serve
    >>> issubclass(ShardLostError, PeerLostError)
    True
"""

from __future__ import annotations

from .errors import PeerLostError
from .placement import (
    DeviceSetter,
    GreedyByBytes,
    Piece,
    Placer,
    RoundRobin,
    device,
    fixed_size_partitioner,
    min_slice_partitioner,
    replica_device_setter,
)
from .ps_client import PSClient
from .ps_protocol import APPLIED, DROPPED, MODES, STOPPED, RemoteError, ShardLostError
from .ps_server import ParameterServer
from .transport import Transport

__all__ = [
    "ParameterServer", "PSClient", "ShardLostError", "RemoteError", "serve", "MODES", "APPLIED", "DROPPED",
    "STOPPED", "device", "replica_device_setter", "DeviceSetter", "RoundRobin", "GreedyByBytes", "Placer",
    "Piece", "fixed_size_partitioner", "min_slice_partitioner", "PeerLostError",
]


def serve(transport: Transport, **options) -> dict:
    """Serve this ps task's shard over ``transport`` (started) until the job ends; return the counters.

    ``options`` go to :class:`ParameterServer` (``timeout``, ``poll``, ``linger``). The strategies call
    it on ps tasks from inside ``stratagem.strategy(...)``; call it yourself only to run a ps task
    without a strategy.
    """
    transport.start()
    return ParameterServer(transport, **options).serve()
