"""A plain script whose worker:0 goes on for two peer timeouts after the others have ended theirs
(alive: its transport's heartbeats go on meanwhile), then ends. The others must wait for it before
``MPI_Finalize`` and the job must succeed: slow is not dead. Each rank prints ``done <task>``.

    stratagem launch --mpi --worker 3 -- python tests/scripts/mpi_slow_end.py

(Run by tests/test_mpi_fault_cells.py, with ``STRATAGEM_PEER_TIMEOUT=1``.)
"""

import time

import numpy as np

import stratagem

comm = stratagem.communicator("mpi")
total = comm.allreduce(np.ones(4))
if comm.rank == 0:
    time.sleep(2 * comm.transport.peer_timeout)
print(f"done {comm.task.short} {total.tolist()}", flush=True)
