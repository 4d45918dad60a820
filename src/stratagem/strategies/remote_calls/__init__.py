"""What the strategies that run a user's functions on other tasks (``in_graph``, ``parameter_server``)
send between tasks: :mod:`.functions` (how a step function travels: by name, or by value when the
cluster is authenticated) and :mod:`.values` (nested arguments and results, never pickled).
"""
