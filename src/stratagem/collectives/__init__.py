"""Collectives: the algorithms written once over the point-to-point transport contract.

- :mod:`.algorithms`: ring, tree and direct all-reduce, broadcast, all-gather, reduce-scatter, barrier;
- :mod:`.session`: one collective call's fingerprint, messages and failure handling;
- :mod:`.communicator`: the public :class:`~stratagem.collectives.communicator.Communicator`
  (``stratagem.communicator()``), which picks a transport's native collective where it has one.
"""
