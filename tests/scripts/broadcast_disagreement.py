"""A plain script whose ranks disagree about a broadcast (tests/test_broadcast_agreement.py): no close(),
no `with`, no guard. Every rank must raise CollectiveMismatchError, the root included.

Arguments: TRANSPORT CASE. ``shape``: the last rank passes an array of another shape than the root's;
``dtype``: of another dtype; ``roots``: every rank names itself the root. Each rank prints
``rank R: ...`` after a broadcast that returned, and ends by the error otherwise.
"""

import sys

import numpy as np

import stratagem

transport, case = sys.argv[1:3]

comm = stratagem.communicator(transport=transport)
x = np.arange(1024, dtype=np.float32)   # 4 KB
last = comm.rank == comm.size - 1
if case == "shape":
    got = comm.broadcast(x if comm.rank == 0 else np.empty(1000 if last else 1024, np.float32), root=0)
elif case == "dtype":
    got = comm.broadcast(x if comm.rank == 0 else np.empty(1024, np.float64 if last else np.float32), root=0)
else:
    got = comm.broadcast(x + comm.rank, root=comm.rank)
print(f"rank {comm.rank}: the broadcast returned {got[:3].tolist()}", flush=True)
