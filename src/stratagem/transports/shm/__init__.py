"""The ``shm`` transport: same-host tasks exchange through shared memory.

:mod:`.transport` (the transport), :mod:`.rendezvous` (segments named and cleaned up), :mod:`.ring`
(a pipelined ring buffer per peer pair), :mod:`.buffers`, :mod:`.collectives` (native all-reduce over
the rings).
"""
