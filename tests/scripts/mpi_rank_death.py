"""The last rank of an MPI job kills itself (SIGKILL); the others must say who died, not hang.

    mpiexec [--with-ft ulfm] -n N python tests/scripts/mpi_rank_death.py p2p|collective

``p2p``: every survivor waits in ``recv`` for a message from the dying rank. ``collective``: every
survivor is in an all-reduce the dying rank never joins. ``close``: as ``collective``, but the last
rank closes its transport (a goodbye) and lives on instead of dying. ``selfclose``: the last rank
lives on without joining, and each survivor's own transport is closed (from another thread) while
it sits in the all-reduce. ``freeze``: the last rank stops itself (SIGSTOP: alive, no MPI progress at
all) and the survivors' all-reduce has a 2 s timeout; then they kill it. A survivor that gets ``PeerLostError``
prints ``LOST <task> after <seconds> s: <message>`` and exits 3; one that gets anything else prints
``OTHER ...`` and exits 4. (Run by tests/test_mpi_transport.py.)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import stratagem
from stratagem.collectives.communicator import Communicator
from stratagem.core.errors import PeerLostError

mode = sys.argv[1]
comm = stratagem.communicator("mpi", timeout=60, transport_options={"peer_timeout": 10.0})
print(f"MODE {comm.task} blocking_collectives={comm.transport.blocking_collectives}", flush=True)
transport = comm.transport
dying = comm.members[-1]
comm.allreduce(np.ones(8))  # everyone is up, and the collective communicator exists
frozen = Communicator(transport, name="frozen", timeout=2)
frozen.barrier()  # its MPI communicator exists too
pids = [int(p) for p in comm.allgather(np.array([os.getpid()]))[:, 0]]
print(f"READY {comm.task}", flush=True)
if comm.task == dying:
    time.sleep(0.5)  # let the others start waiting
    if mode == "close":
        comm.close()
        time.sleep(8)  # alive, silent: only the goodbye tells the others
        os._exit(0)
    if mode == "selfclose":
        time.sleep(5)  # alive (heartbeats go on), never joining
        os._exit(0)
    if mode == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGKILL)
started = time.monotonic()
if mode == "selfclose":
    threading.Timer(1.0, transport.close).start()
try:
    if mode == "p2p":
        transport.recv(dying, "never-sent", timeout=60)
    elif mode == "freeze":
        frozen.allreduce(np.ones(1 << 16, np.float32))
    else:
        comm.allreduce(np.ones(1 << 16, np.float32))
    print(f"NOERROR {comm.task}", flush=True)
    sys.exit(0)
except PeerLostError as exc:
    print(f"LOST {exc.task} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
    sys.exit(3)
except Exception as exc:  # noqa: BLE001 - reported for the test
    print(f"OTHER {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
    if mode == "freeze":  # the stopped rank would keep MPI_Finalize (and the job) waiting for ever
        os.kill(pids[-1], signal.SIGKILL)
    sys.exit(4)
