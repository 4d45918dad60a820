"""The parameter-server service (README: "Parameter servers"): variables held by ``ps`` tasks, updated there.

The service is split by job:

- :mod:`.placement` decides which ps task holds each variable (round-robin, greedy by bytes, or
  explicit ``stratagem.device("/job:ps/task:1")``) and partitions large ones;
- :mod:`.protocol` is the protocol: operations, piece descriptions, errors; :mod:`.messages` the
  push and its acknowledgement as typed objects, built and read in one place;
- :mod:`.server` is what a ps task runs: :class:`~stratagem.ps_service.server.ParameterServer` (server-side
  optimizer per shard, a global step, versions; it takes the pushes and acknowledges them), with the
  bookkeeping of the ``sync`` and ``bounded`` consistency modes in :mod:`.consistency`, row updates in
  :mod:`.rows`, double-buffered replies in :mod:`.buffers` and a sync job's replies taking turns on
  the link in :mod:`.turns`;
- :mod:`.client` is what workers use: :class:`~stratagem.ps_service.client.PSClient`, requests batched per
  shard and sent to all shards concurrently.

The strategies built on it (``between_graph``, ``parameter_server``) are in :mod:`stratagem.strategies.ps`.
Everything moves as wire messages (metadata + array buffers) through the transport contract; nothing
is pickled.
"""
