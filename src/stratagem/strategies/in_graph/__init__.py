"""The ``in_graph`` strategy: one client (the chief) drives replicas on every worker.

- :mod:`.strategy`: the strategy object; :mod:`.client`: the chief's side; :mod:`.replica`: what a
  worker runs; :mod:`.devices`: replica devices; :mod:`.functions`: how step functions reach a replica;
  :mod:`.batches`: splitting the batch, and the replicas' results (values travel as :mod:`stratagem.strategies.remote_calls.values`).
"""
