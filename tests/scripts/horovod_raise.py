"""A Horovod script whose rank 1 fails after its first all-reduce (tests/test_horovod.py): rank 0's next
all-reduce must raise PeerLostError naming worker:1 at once. A plain script: numpy arrays, no torch."""

import numpy as np

import stratagem.horovod as hvd

hvd.init()
assert hvd.allreduce(np.ones(4, np.float32), op=hvd.Sum).tolist() == [2.0] * 4
if hvd.rank() == 1:
    raise RuntimeError("rank 1 ran out of luck")
hvd.allreduce(np.ones(4, np.float32))
print("rank 0 went on without rank 1")
