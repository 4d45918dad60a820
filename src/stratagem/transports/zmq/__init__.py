"""The ``zmq`` transport (pyzmq): :mod:`.transport` (sockets, the reader loop, sends) and
:mod:`.acceptor` (the handshake of incoming connections). Imported only when the plugin is used.
"""
