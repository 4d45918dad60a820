"""Reports the transport a script gets from ``stratagem`` when it names none, as one JSON line.

    stratagem launch --worker 2 [--transport T] -- python tests/scripts/default_transport.py [strategy] [explicit:NAME]

With no argument it opens ``stratagem.communicator()`` and all-reduces; with ``strategy`` it creates
``stratagem.strategy("mirrored")`` instead; ``explicit:NAME`` passes ``transport=NAME`` (which must
win over the environment). Run by tests/test_launcher.py.
"""

import json
import sys

import numpy as np

import stratagem

args = sys.argv[1:]
options = dict(arg.split(":", 1) for arg in args if ":" in arg)
chosen = {"transport": options["explicit"]} if "explicit" in options else {}
if "strategy" in args:
    with stratagem.strategy("mirrored", timeout=60, **chosen) as strategy:
        total = strategy.reduce("sum", float(strategy.task.index + 1))
        print(json.dumps({"transport": strategy.transport_name, "class": type(strategy.transport).__name__,
                          "sum": float(total)}))
else:
    comm = stratagem.communicator(timeout=60, **chosen)
    total = comm.allreduce(np.array([comm.rank + 1.0]))
    print(json.dumps({"transport": comm.transport.name, "class": type(comm.transport).__name__,
                      "sum": float(total[0])}))
    comm.close()
