"""A plain communicator script over the ``shm`` transport (tests/test_shm_transport.py).

All-reduces of odd sizes (one element, a prime count, more than a ring holds), each checked against
the exact result, and a broadcast of a buffer larger than a ring from rank 0.
"""

import numpy as np

import stratagem

comm = stratagem.communicator(transport="shm")
for n in (1, 1_000_003, (9 << 20) // 8 + 7):
    total = comm.allreduce(np.arange(n, dtype=np.float64) * (comm.rank + 1))
    expected = np.arange(n, dtype=np.float64) * (comm.size * (comm.size + 1) // 2)
    assert np.array_equal(total, expected), f"rank {comm.rank}: all-reduce of {n} elements is wrong"
big = comm.broadcast(np.arange(5_000_001, dtype=np.int32) if comm.rank == 0 else None, root=0)
assert big.shape == (5_000_001,) and int(big[-1]) == 5_000_000 and int(big[12345]) == 12345
print(f"rank {comm.rank}: ok")
