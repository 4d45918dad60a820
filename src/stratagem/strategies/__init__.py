"""The built-in strategies, each a plugin registered by :mod:`stratagem.plugins.builtin`.

Create one by name with ``stratagem.strategy("mirrored", transport="zmq")``; the modules here are
imported only when their strategy is used.

- :mod:`~stratagem.strategies.mirrored.strategy`: a copy of every variable on every replica, gradients
  all-reduced every step.
- :mod:`~stratagem.strategies.ps.between_graph`: variables on ps tasks; every worker runs its own loop
  (async, sync with backup workers, or bounded staleness).
- :mod:`~stratagem.strategies.ps.parameter_server`: variables on ps tasks; a coordinator schedules step
  functions onto the workers.
- :mod:`~stratagem.strategies.in_graph.strategy`: one client splits each batch over its devices and the
  worker tasks, merges the gradients and applies one update.
"""
