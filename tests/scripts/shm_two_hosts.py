"""A task of tests/test_shm_across_hosts.py: collectives and messages over transport='shm' with
remote='zmq', in a cluster whose tasks sit on two hosts. Prints one JSON line: its results, and which
shared-memory rings this process maps (from /proc/self/maps: a ring is a memfd named
'<cluster>:<from>-><to>')."""
import json
import re
import sys

import numpy as np

import stratagem
from stratagem.core.transport import Message

comm = stratagem.communicator(transport="shm", transport_options={"remote": "zmq"})
small = comm.allreduce(np.full(1000, comm.rank + 1, np.float32))
if comm.rank == 2 and "--die" in sys.argv:   # the task on the other host dies: the others must say so
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
large = comm.allreduce(np.full(3_000_000, comm.rank + 1, np.float32))   # 12 MB: the native size, declined
everyone = comm.allgather(np.array([comm.rank]))
t = comm.transport
# every task sends every other a message of its own; what arrives says who sent it
for peer in t.cluster.tasks():
    if peer != t.task:
        t.send(peer, "hello", Message({"from": t.task.short}, [np.arange(5.0) * comm.rank]))
heard = {}
for _ in range(comm.size - 1):
    m = t.recv(None, "hello", timeout=30)
    heard[m.meta["from"]] = m.buffers[0].tolist()
# The rings mapped now, every message having arrived (read before the barrier: a peer that has passed
# it may end, and a peer's end unmaps our rings to it)
with open("/proc/self/maps") as f:
    rings = sorted(set(re.findall(r"memfd:stratagem-shm:[^:]{8}:(\S+->\S+)", f.read())))
comm.barrier()
print(json.dumps({"task": t.task.short, "ring_peers": sorted(p.short for p in t.ring_peers),
                  "small": float(small[0]), "large": [float(large[0]), float(large[-1])],
                  "everyone": everyone.ravel().tolist(), "heard": heard, "rings": rings}), flush=True)
if comm.rank == 0 and "--fail" in sys.argv:
    raise RuntimeError("worker:0 fails after its work")
