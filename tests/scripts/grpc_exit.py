"""A two-task grpc job whose first task ends its part the way users' scripts do, without closing.

    STRATAGEM_CONFIG=... python tests/scripts/grpc_exit.py normal|raise|exit3|abort|close

Both tasks open ``stratagem.communicator(transport="grpc")`` (cluster and task from
``STRATAGEM_CONFIG``) and all-reduce once, so every stream is up. Then ``worker:0``, never calling
``close()``, returns from the script (``normal``), raises an uncaught ``RuntimeError`` (``raise``) or
calls ``sys.exit(3)`` (``exit3``); or it calls ``transport.abort()`` (``abort``) or ``comm.close()``
(``close``), prints ``ABORTED``/``CLOSED`` and stays alive until its stdin is closed, so that only
what ``abort``/``close`` did can tell the other task. ``worker:1`` waits in ``recv`` for a message
``worker:0`` never sends: it prints ``LOST <task> after <seconds> s: <message>`` on
``PeerLostError``, or ``OTHER ...`` on anything else, and then also ends without closing.
(Run by tests/test_grpc_exit.py.)
"""

from __future__ import annotations

import sys
import time

import numpy as np

import stratagem
from stratagem.core.errors import PeerLostError

mode = sys.argv[1]
comm = stratagem.communicator("grpc", timeout=60, transport_options={"peer_timeout": 10.0})
ending, waiting = comm.members
total = comm.allreduce(np.ones(4))
print(f"READY {comm.task} {total.tolist()}", flush=True)
if comm.task == ending:
    time.sleep(0.3)  # let the other task start waiting
    if mode == "raise":
        raise RuntimeError("the user's script failed")
    if mode == "exit3":
        sys.exit(3)
    if mode in ("abort", "close"):
        if mode == "abort":
            comm.transport.abort()
        else:
            comm.close()
        print(f"{mode.upper().rstrip('E')}ED {comm.task}", flush=True)
        sys.stdin.read()  # alive, with its process's sockets, until the test lets it go
    print(f"END {comm.task}", flush=True)
else:
    started = time.monotonic()
    try:
        comm.transport.recv(ending, "never-sent", timeout=60)
        print(f"NOERROR {comm.task}", flush=True)
    except PeerLostError as exc:
        print(f"LOST {exc.task} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported for the test
        print(f"OTHER {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
