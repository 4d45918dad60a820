"""``stratagem bench``: compare strategies and transports on this machine (see :mod:`.train` and
:mod:`.collectives`); the models it trains are in :mod:`.models`."""
