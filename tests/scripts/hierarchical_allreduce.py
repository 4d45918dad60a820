"""A task of tests/test_hierarchical.py, as a user writes it (no close(), no guard): all-reduces over
shared memory inside each host and zmq between hosts, ``hierarchical=True``, on 2 emulated hosts of 2
tasks. Prints one JSON line: whether the results were the exact sums, and the payload bytes it sent to
each peer during the large all-reduce, and the shared-memory rings it maps (from /proc/self/maps: a ring is
a memfd named '<cluster>:<from>-><to>'). ``mismatch``: worker:3 passes a shorter array to the second large
all-reduce, so every task raises CollectiveMismatchError and the script ends by it."""
import json
import re
import sys

import numpy as np

import stratagem

comm = stratagem.communicator(transport="shm", transport_options={"remote": "zmq"}, hierarchical=True)
n = 1 << 20                                       # 4 MiB of float32: the bandwidth-bound size, hierarchical
x = (np.arange(n, dtype=np.float32) % 7) + comm.rank
expected = 4 * (np.arange(n, dtype=np.float32) % 7) + 6
small = comm.allreduce(np.full(3, comm.rank + 1.0))   # a latency-bound size: the flat direct exchange
before = comm.transport.traffic.snapshot()
total = comm.allreduce(x)
sent = {peer.short: counts[0] for peer, counts in (comm.transport.traffic.snapshot() - before).peers.items()
        if peer is not None}
with open("/proc/self/maps") as f:   # now: every peer waits for this task in the next call, none has left
    rings = sorted(set(re.findall(r"memfd:stratagem-shm:[^:]{8}:(\S+->\S+)", f.read())))
mean = comm.allreduce(x[:-1] if "mismatch" in sys.argv[1:] and comm.rank == 3 else x, op="mean")
print(json.dumps({"task": comm.task.short, "sum_exact": bool(np.array_equal(total, expected)),
                  "mean_exact": bool(np.array_equal(mean, expected / 4)), "small": small.tolist(),
                  "sent": sent, "rings": rings}), flush=True)
