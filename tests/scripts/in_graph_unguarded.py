"""A script that forgets the main guard (tests/test_in_graph.py): its training loop runs at the top
level, so a replica that imports the script to find ``step`` would run it too; the client must get a
clear error saying what to change."""

import numpy as np

import stratagem

strategy = stratagem.strategy("in_graph", transport="zmq", timeout=20, transport_options={"timeout": 20})
with strategy.scope():
    w = stratagem.Variable(np.zeros(2), name="w")
    opt = stratagem.optimizers.SGD(0.1)


def step(x):
    opt.apply_gradients([(x.mean(axis=0), w)])


for _ in range(2):
    strategy.run(step, args=(np.ones((4, 2)),))
strategy.shutdown()
