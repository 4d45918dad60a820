"""The strategies on parameter servers: ``between_graph`` and ``parameter_server``.

- :mod:`.base`: what both share (remote variables on the shards, initialisation by the chief, the
  ps tasks' side); :mod:`.remote`: the registry of this task's variables on the shards (pieces,
  caches, staleness, the pushes' requests); :mod:`.cache`: how received values get into the caches;
  :mod:`.checkpoint`: their checkpoints;
- :mod:`.between_graph`: every worker runs its own loop and pushes to the shards;
- :mod:`.parameter_server`: a coordinator schedules closures on workers (:mod:`.coordinator`,
  :mod:`.worker`, which adopts the coordinator's variables through :mod:`.adopt`), with functions and values shipped by
  :mod:`stratagem.strategies.remote_calls.functions` and :mod:`stratagem.strategies.remote_calls.values`.

The service itself (server, client, protocol) is :mod:`stratagem.ps_service`.
"""
