"""A plain training script in which worker:1 fails at its fourth step (tests/test_first_failure.py).

    first_failure.py STRATEGY TRANSPORT ENDING        (cluster and task from stratagem launch)

ENDING: ``stop`` (worker:1 stops itself with SIGSTOP: alive, silent, never exits on its own) or
``raise`` (worker:1 raises; its own cleanup at exit then takes a while, as a user's atexit handler
that uploads logs does, so its peers, which fail at once naming it, exit before it). worker:2 is
slow at every step. Like a user's script: no close(), no shutdown(), no ``__main__`` guard.
"""

import atexit
import os
import signal
import sys
import time

import numpy as np

import stratagem
from stratagem.core.cluster import ClusterResolver

strategy_name, transport, ending = sys.argv[1:4]
strategy = stratagem.strategy(strategy_name, transport=transport, transport_options={"peer_timeout": 2.0})
with strategy.scope():
    w = stratagem.Variable(np.zeros(4, np.float32), name="w")
    opt = stratagem.optimizers.SGD(0.1)


def step(x):
    # Where it runs, and how many steps ran there (under in_graph the step travels to each replica with
    # the client's globals, so both are read from the process itself).
    me = ClusterResolver.from_env().task.short
    calls = int(os.environ.get("FIRST_FAILURE_STEPS", "0")) + 1
    os.environ["FIRST_FAILURE_STEPS"] = str(calls)
    if me == "worker:2":
        time.sleep(0.2)            # the slow one: never the culprit
    if me == "worker:1" and calls == 4:
        if ending == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        atexit.register(time.sleep, 1.5)
        raise RuntimeError("worker:1 failed on purpose")
    opt.apply_gradients([(x.mean(axis=0), w)])


for i in range(50):
    strategy.run(step, args=(np.ones((6, 4), np.float32),))
print(f"trained: w = {w.value.tolist()}")
