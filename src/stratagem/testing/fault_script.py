"""The plain training script of :mod:`stratagem.testing.faults`, as a user writes it (no close(), no
``__main__`` guard), under any strategy, with hooks a fault test drives from outside. Importing this
module runs it: ``python -m stratagem.testing.fault_script STRATEGY [options]``.

The transport is the environment's (``stratagem launch --transport``), and so is the peer timeout
(``STRATAGEM_PEER_TIMEOUT``). Every task prints ``pid <pid>`` first; the tasks that run the training
loop print ``step <i>`` before each step and ``trained: w = [...]`` at the end. SIGUSR1 makes the main
thread raise ``RuntimeError("<task> failed on purpose")``, SIGUSR2 makes it ``sys.exit(3)``, wherever
it is (in the loop, or serving inside ``stratagem.strategy()``). When an error ends the script, it
prints one line ``error {"error": ..., "message": ..., "task": <the task it names>, "at": <monotonic>}``
first. ``--compute TASK:SECONDS:KIND`` makes TASK's step 3 take SECONDS longer: ``numpy`` (matrix
products, the GIL released) or ``python`` (a pure-Python loop holding the GIL).
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import stratagem
from stratagem.core.cluster import ClusterResolver

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--pause", type=float, default=0.05, help="seconds each step sleeps (the input pipeline)")
parser.add_argument("--compute", default="", metavar="TASK:SECONDS:KIND")
args = parser.parse_args()
parts = args.compute.split(":") if args.compute else ["", "", "0", ""]    # worker:1:6:numpy
compute_task, compute_seconds, compute_kind = ":".join(parts[:2]), float(parts[2]), parts[3]
me = ClusterResolver.from_env().task.short      # STRATAGEM_CONFIG, or the MPI rank under --mpi
print(f"pid {os.getpid()}", flush=True)


def fail(signum, frame):
    raise RuntimeError(f"{me} failed on purpose")


def leave(signum, frame):
    sys.exit(3)


signal.signal(signal.SIGUSR1, fail)
signal.signal(signal.SIGUSR2, leave)


def compute(seconds: float, kind: str) -> None:
    end = time.monotonic() + seconds
    if kind == "numpy":
        a = np.random.default_rng(0).random((256, 256))
        while time.monotonic() < end:
            a = np.tanh(a @ a)
    else:
        x = 0
        while time.monotonic() < end:
            for _ in range(10_000):
                x += 1


try:
    name, _, mode = args.strategy.partition(":")     # e.g. between_graph:sync
    strategy = stratagem.strategy(name, **({"mode": mode} if mode else {}))
    with strategy.scope():
        w = stratagem.Variable(np.zeros(4, np.float32), name="w")
        opt = stratagem.optimizers.SGD(0.1)

    def step(x):    # defined after the strategy, as in plain_training: a serving task gets it by value
        opt.apply_gradients([(x.mean(axis=0), w)])

    for i in range(args.steps):
        print(f"step {i}", flush=True)
        if i == 3 and me == compute_task:
            compute(compute_seconds, compute_kind)
        strategy.run(step, args=(np.ones((4, 4), np.float32),))
        time.sleep(args.pause)
    print(f"trained: w = {w.value.tolist()}", flush=True)
except BaseException as exc:
    if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
        named = getattr(exc, "task", None)
        print("error " + json.dumps({"error": type(exc).__name__, "message": str(exc)[:500],
                                     "task": str(named) if named is not None else None, "at": time.monotonic()}),
              flush=True)
    raise
