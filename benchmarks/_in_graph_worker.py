"""One task of the ``in_graph`` MLP benchmark (started by benchmarks/in_graph.py; not run by hand).

    _in_graph_worker.py SPEC OUT

SPEC is a JSON file: ``{"label", "sizes": [784, 512, 512, 10], "batch" (rows per replica), "warmup",
"steps", "lr", "devices" (the client's CPU replicas), "timeout"}``. Every task runs this script under
``stratagem launch``: worker tasks serve inside ``stratagem.strategy("in_graph", ...)``; the client
(worker:0) trains and writes OUT (JSON). The step function is at the top level, so the replicas find
it by name (they import this script; the loop is under the main guard).

The model and the data are those of the mirrored benchmark (_mlp_training_worker.py): an MLP, float32,
plain SGD, numpy forward and backward, a fixed synthetic global batch of ``batch`` rows per replica.
The client times each ``strategy.run`` (split, values and shards out, every replica's step, gradients
back, merge, update) and counts the payload it hands its transport per step.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import stratagem
from _mlp_training_worker import NumpyMLP, initial_params, synthetic_batch

with open(sys.argv[1]) as _f:
    SPEC = json.load(_f)

strategy = stratagem.strategy("in_graph", transport="zmq", devices=SPEC.get("devices", 1),
                              timeout=SPEC.get("timeout", 120), transport_options={"timeout": SPEC.get("timeout", 120)})
with strategy.scope():
    variables = [stratagem.Variable(value, name=name) for name, value in initial_params(SPEC["sizes"])]
    opt = stratagem.optimizers.SGD(learning_rate=SPEC["lr"])


def train_step(x, y):
    opt.apply_gradients(NumpyMLP(variables, x, y).grads())


def main() -> None:
    n = strategy.num_replicas_in_sync
    x, y = synthetic_batch(SPEC["sizes"], SPEC["batch"] * n, 0)
    sent = [0]
    transport = strategy.transport
    original = transport.send_async

    def counted(dst, tag, msg, *args, **kwargs):
        sent[0] += msg.nbytes
        return original(dst, tag, msg, *args, **kwargs)

    transport.send_async = counted
    with strategy:
        for _ in range(SPEC["warmup"]):
            strategy.run(train_step, args=(x, y))
        steps = SPEC["steps"]
        step_s, sent_per_step = np.zeros(steps), np.zeros(steps)
        start = time.perf_counter()
        for i in range(steps):
            sent[0] = 0
            t0 = time.perf_counter()
            strategy.run(train_step, args=(x, y))
            step_s[i] = time.perf_counter() - t0
            sent_per_step[i] = sent[0]
        wall = time.perf_counter() - start
    with open(sys.argv[2], "w") as f:
        json.dump({"label": SPEC["label"], "np": n, "batch": SPEC["batch"], "steps": steps, "wall_s": wall,
                   "step_s": step_s.tolist(), "bytes_sent_per_step": float(np.median(sent_per_step)),
                   "replicas": strategy.replicas}, f)


if __name__ == "__main__":
    main()
