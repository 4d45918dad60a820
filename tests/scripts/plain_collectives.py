"""The plain communicator script (tests/test_script_endings.py): no close(), no `with`, no guard.

Arguments: TRANSPORT [ENDING]. ``mismatch``: at the third call the last rank all-reduces an array of
another shape than the others, so every rank raises CollectiveMismatchError and the script ends by it.
"""

import sys

import numpy as np

import stratagem

transport = sys.argv[1]
ending = sys.argv[2] if len(sys.argv) > 2 else None

comm = stratagem.communicator(transport=transport)
for i in range(5):
    if i == 2 and ending == "mismatch" and comm.rank == comm.size - 1:
        comm.allreduce(np.ones(4))
    else:
        total = comm.allreduce(np.full(3, comm.rank + 1.0))
print(f"rank {comm.rank}: total = {total.tolist()}")
