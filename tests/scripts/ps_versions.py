"""Every reply of a parameter server holds one version of the values, over zmq (tests/test_between_graph.py).

    ps_versions.py OUT_DIR STEPS         (under ``stratagem launch --ps 1 --worker 2``)

Each worker pushes gradients of ones for 4 variables of 1M float32 and one of 1.5M (22 MB: the replies
come in parts, each sent as soon as its pieces are updated, and a reply may still be on the wire
while the other worker's push updates the values; the large variable is held as two pieces, each
within what zmq delivers whole), with SGD(learning_rate=1), ``async``, the values coming back with
each push. After every push, every element of every variable must equal ``-global_step`` of that
same reply: a reply mixing two versions, or values of another step than the one it reports, shows.
Workers write ``OUT_DIR/worker_<i>.json``: the steps they saw, the pushes whose values were wrong and
the pieces of each variable.
"""

import json
import os
import sys

import numpy as np

import stratagem

out, steps = sys.argv[1], int(sys.argv[2])
strategy = stratagem.strategy("between_graph", transport="zmq", mode="async", exit_after_serving=True,
                              transport_options={"timeout": 60})
size = 1 << 20
with strategy.scope():
    variables = [stratagem.Variable(np.zeros(size, np.float32), name=f"v{i}") for i in range(4)]
    variables.append(stratagem.Variable(np.zeros((size * 3 // 8, 4), np.float32), name="big"))
    opt = stratagem.optimizers.SGD(learning_rate=1.0)
ones = [np.ones(v.shape, np.float32) for v in variables]
seen, wrong = [], []
for _ in range(steps):
    opt.apply_gradients(list(zip(ones, variables)))
    step = strategy.global_step
    values = {float(x) for v in variables for x in (v.value.min(), v.value.max())}
    if values != {-float(step)}:
        wrong.append({"step": step, "values": sorted(values)})
    seen.append(step)
with open(os.path.join(out, f"{strategy.task.job}_{strategy.task.index}.json"), "w") as f:
    json.dump({"seen": seen, "wrong": wrong,
               "pieces": {v.name: [p.name for p in strategy.pieces(v.name)] for v in variables}}, f)
strategy.shutdown()
