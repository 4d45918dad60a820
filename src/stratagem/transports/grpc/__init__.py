"""The ``grpc`` transport (grpcio): :mod:`.transport`, :mod:`.acceptor` (incoming streams'
handshake), :mod:`.streams`, :mod:`.config` (channel options), :mod:`.threads` (daemon executor).
Imported only when the plugin is used (``pip install 'stratagem[grpc]'``).
"""
