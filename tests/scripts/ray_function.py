"""A user's script for ``stratagem.ray.run`` with a function (tests/test_ray.py).

    python3 ray_function.py RAY_ADDRESS [--spread]

Every task runs ``train``: an all-reduce of its rank + 1 over the job's communicator, and a report of
what its environment held. The script prints the job's result as JSON on its last line.
"""

import json
import os
import sys

import numpy as np

import stratagem


def train():
    with stratagem.communicator() as comm:
        total = comm.allreduce(np.full(4, comm.rank + 1.0, np.float32), op="sum")
        print(f"rank {comm.rank} of {comm.size}: sum {total[0]:g}")
        return {"task": comm.task.short, "rank": comm.rank, "sum": total.tolist(),
                "authenticated": bool(os.environ.get("STRATAGEM_SECRET"))}


if __name__ == "__main__":
    result = stratagem.ray.run(train, worker=2, address=sys.argv[1], spread="--spread" in sys.argv,
                               timeout=90, placement_timeout=30)
    print(json.dumps({"exit_code": result.exit_code, "values": result.values, "nodes": result.nodes,
                      "cluster": result.cluster.as_dict()}))
    sys.exit(result.exit_code)
