"""A communicator beside a strategy in one process, the plain script (no close(), no __main__ guard).

``--communicator-first`` makes the communicator before the strategy. Every task prints one line
``beside: <rank> <all-reduce> <strategy reduce> <w>`` (tests/test_tf_distribute.py).
"""
import sys

import numpy as np
import stratagem

if "--communicator-first" in sys.argv:
    comm = stratagem.communicator()
    strategy = stratagem.strategy("mirrored")
else:
    strategy = stratagem.strategy("mirrored")
    comm = stratagem.communicator()
with strategy.scope():
    w = stratagem.Variable(np.zeros(2), name="w")
    optimizer = stratagem.optimizers.SGD(learning_rate=1.0)
total = comm.allreduce(np.full(3, comm.rank + 1.0), op="sum")
optimizer.apply_gradients([(np.full(2, comm.rank + 1.0), w)])
reduced = strategy.reduce("sum", float(comm.rank))
comm.barrier()
print("beside:", comm.rank, total.tolist(), reduced, w.value.tolist())
