"""The linear regression under the ``parameter_server`` strategy, for tests/test_parameter_server.py.

    ps_coordinator.py --out DIR [--steps N] [--mode M] [--die-task worker:1 --die-at K] [--lambda]
                      [--step-seconds S]

Run under ``stratagem launch --chief --worker W --ps P``: the chief coordinates, the workers run the
steps (each on its own per-worker dataset), the ps tasks hold W and b. The chief writes
``DIR/chief_0.json``: final W and b, results fetched, closures executed per worker, closures retried.
``--die-task T --die-at K``: worker T SIGKILLs itself in the middle of its K-th step (after pulling,
before pushing). ``--lambda``: the step is a lambda defined after ``stratagem.strategy(...)``, so it
must travel with cloudpickle (the launcher's secret authenticates the cluster). ``--step-seconds S``:
each step also sleeps S seconds (training lasts long enough for a restarted worker to come back).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import numpy as np  # noqa: E402

import stratagem  # noqa: E402
from linear_regression_ps import batch, loss_and_grads  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--mode", default="async")
parser.add_argument("--die-task")
parser.add_argument("--die-at", type=int)
parser.add_argument("--lambda", dest="use_lambda", action="store_true")
parser.add_argument("--step-seconds", type=float, default=0.0)
args = parser.parse_args()
signal.signal(signal.SIGTERM, lambda *_: None)

STEPS_RUN = {"n": 0}


def dataset_fn(context):
    """Each worker's endless stream of batches, seeded by its index."""
    step = 0
    while True:
        yield batch(0, context.worker_index, step, 100)
        step += 1


def train_step(iterator, w, b, opt, strategy):
    """One step on this worker: pull W and b, compute, push. Defined before stratagem.strategy(): by name."""
    x, y = next(iterator)
    loss, grad_w, grad_b = loss_and_grads(w.value, b.value, x, y)
    STEPS_RUN["n"] += 1
    if strategy.task.short == args.die_task and STEPS_RUN["n"] == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(args.step_seconds)
    opt.apply_gradients([(grad_w, w), (grad_b, b)])
    return {"loss": loss, "worker": strategy.task.index}


# ps tasks and workers serve inside this call, and exit when the coordinator is done.
strategy = stratagem.strategy("parameter_server", transport="zmq", mode=args.mode,
                              transport_options={"timeout": 60, "peer_timeout": 5})
with strategy.scope():
    w = stratagem.Variable(np.random.default_rng(0).uniform(-1, 1, 1).astype(np.float32), name="W")
    b = stratagem.Variable(np.zeros(1, np.float32), name="b")
    opt = stratagem.optimizers.SGD(learning_rate=0.1)
iterator = iter(strategy.create_per_worker_dataset(dataset_fn))
step = train_step
if args.use_lambda:
    step = lambda it, w_, b_, o, s: train_step(it, w_, b_, o, s)  # noqa: E731 - sent with cloudpickle
results = [strategy.schedule(step, args=(iterator, w, b, opt, strategy)) for _ in range(args.steps)]
strategy.join()
fetched = [r.fetch() for r in results]
record = {"W": float(w.numpy()[0]), "b": float(b.numpy()[0]), "results": len(fetched),
          "workers_in_results": sorted({f["worker"] for f in fetched}),
          "executed": {str(k): v for k, v in strategy.coordinator.executed.items()},
          "retried": strategy.coordinator.retried, "global_step": strategy.refresh()}
with open(os.path.join(args.out, "chief_0.json"), "w") as f:
    json.dump(record, f)
strategy.shutdown()
