"""Each rank reports the task the MPI world gave it, and the roles talk (run by tests/test_mpi_transport.py).

    stratagem launch --mpi --worker 2 --ps 1 -- python tests/scripts/mpi_roles.py [fail:RANK] [netns:PATH]

Workers all-reduce among themselves (the default communicator: chief and workers); every worker
sends its rank to ``ps:0``, which answers each with the total. Prints ``TASK <task> rank <r> of <n>
transport <name>`` and ``SUM ...``/``PS ...`` lines. ``fail:R`` makes rank R exit 3 after the work;
``netns:PATH`` makes rank 0 write its network namespace there.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from stratagem.core.cluster import ClusterResolver
from stratagem.collectives.communicator import Communicator
from stratagem.core.transport import Message
from stratagem.plugins.manager import plugin_manager

options = dict(arg.split(":", 1) for arg in sys.argv[1:])
resolved = ClusterResolver.from_env()
name = os.environ.get("STRATAGEM_TRANSPORT", "?")
transport = plugin_manager().create_transport(name, cluster=resolved.cluster, task=resolved.task, timeout=60)
transport.start()
rank = resolved.cluster.tasks().index(resolved.task)
print(f"TASK {resolved.task} rank {rank} of {len(resolved.cluster)} transport {transport.name} "
      f"chief={resolved.is_chief} source={resolved.source}", flush=True)
if rank == 0 and "netns" in options:
    with open(options["netns"], "w") as f:
        f.write(os.readlink("/proc/self/ns/net"))
workers = resolved.cluster.replicas()
if resolved.task.job == "ps":
    for _ in workers:
        message = transport.recv(None, "value", timeout=60)
        transport.send(message.src, "total", Message({"total": int(message.meta["value"]) * 100}))
    print(f"PS served {len(workers)} workers", flush=True)
else:
    comm = Communicator(transport, timeout=60)
    total = comm.allreduce(np.array([comm.rank + 1.0]))
    print(f"SUM {total[0]:g} over {comm.size} workers", flush=True)
    ps = resolved.cluster.tasks("ps")
    if ps:
        transport.send(ps[0], "value", Message({"value": comm.rank}))
        print(f"PS answered {transport.recv(ps[0], 'total', timeout=60).meta['total']}", flush=True)
    comm.barrier()
transport.close()
sys.exit(3 if options.get("fail") == str(rank) else 0)
