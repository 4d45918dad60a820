"""The transport kit: what the network transports (zmq, grpc, shm's control path) are built from.

:mod:`.handshake` (the authenticated hello, both sides), :mod:`.acceptor` (its accepting side, a state
machine without I/O), :mod:`.mailbox` (messages waiting for their receiver), :mod:`.reading` (who
reads: a waiting recv itself, else a background thread) and :mod:`.ports` (free ports, also for the
launcher). Transports and the launcher import it; strategies never do.
"""
