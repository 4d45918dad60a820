"""A plain user script training with compressed gradients: no close(), no shutdown(), no `with`, no
`__main__` guard (tests/test_compression_training.py runs it as every task of a cluster).

    compressed_train.py STRATEGY COMPRESSION OPTIONS_JSON [TASK ENDING]

A linear model ``y = x W + b`` (W 32 x 8) fitted by SGD on batches of a fixed random problem; the
gradients go through ``compression=COMPRESSION`` (``none`` for none) with ``compression_options``
from OPTIONS_JSON. Every training task prints ``loss L`` (the last global batch's, before its update:
``strategy.reduce`` under mirrored) at the end. With TASK ENDING, task TASK raises in the middle of
training (ENDING ``raise``).
"""

import json
import sys

import numpy as np

import stratagem

name, compression, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
failing_task, ending = sys.argv[4:6] if len(sys.argv) > 5 else (None, None)
extra = {"mode": "sync"} if name == "between_graph" else {}

strategy = stratagem.strategy(name, transport="zmq", compression=None if compression == "none" else compression,
                              compression_options=options or None, **extra)
rng = np.random.default_rng(0)
true_w, true_b = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
with strategy.scope():
    w = stratagem.Variable(np.zeros((32, 8), np.float32), name="w")
    b = stratagem.Variable(np.zeros(8, np.float32), name="b")
    opt = stratagem.optimizers.SGD(learning_rate=0.1)


def global_batches(steps, rows=64):
    data = np.random.default_rng(1)
    for _ in range(steps):
        x = data.normal(size=(rows, 32)).astype(np.float32)
        yield x, x @ true_w + true_b


loss = None
for step, (x, y) in enumerate(strategy.distribute_dataset(global_batches(300))):
    if step == 150 and strategy.task.short == failing_task and ending == "raise":
        raise RuntimeError(f"{failing_task} failed on purpose")
    error = x @ w.value + b.value - y
    loss = float(np.mean(error ** 2))
    opt.apply_gradients([(2 * x.T @ error / error.size, w), (2 * error.mean(axis=0), b)])
if name == "mirrored":
    loss = strategy.reduce("mean", loss)
print(f"loss {loss:.6g}")
