"""One replica of elastic mirrored training, the plain script a user writes (no main guard, no
shutdown), run by ``stratagem launch`` in tests/test_elastic.py.

    elastic_train.py --out DIR --steps M [--batch B] [--optimizer sgd|adam] [--die-at K]
                     [--die-task worker:2] [--no-shrink] [--wait-for 3] [--transport zmq]

Trains the MLP of mirrored_model.py with ``on_failure="shrink"`` inside ``strategy.elastic``.
``--die-at K``: the first process of ``--die-task`` SIGKILLs itself in step K (gradients computed, not
yet all-reduced); a process restarted by ``--restart-workers`` (STRATAGEM_RESTARTS set) does not.
``--wait-for N``: the first time fewer than N replicas train, they commit every 0.2 s (for at most
30 s) before the step, so that a restarted worker has time to come up and rejoin on a loaded machine
(it joins at one of those commits). Each replica writes
``DIR/<job>_<index>.npz`` (final parameters) and ``.json`` (iterations, resets seen, replicas at the
end, whether it joined late) when training ends.
"""

import argparse
import json
import os
import signal
import time

import numpy as np

import mirrored_model as model
import stratagem

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--batch", type=int, default=23)
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--die-at", type=int)
parser.add_argument("--die-task", default="worker:2")
parser.add_argument("--no-shrink", action="store_true")
parser.add_argument("--wait-for", type=int, default=0)
parser.add_argument("--transport", default="zmq")
args = parser.parse_args()

strategy = stratagem.strategy("mirrored", transport=args.transport,
                              on_failure="raise" if args.no_shrink else "shrink",
                              timeout=30, transport_options={"timeout": 30, "peer_timeout": 5})
me = strategy.task
first_process = not os.environ.get("STRATAGEM_RESTARTS")
with strategy.scope():
    params, opt = model.create(args.optimizer, seed=1 if strategy.is_chief else 50 + me.index)

resets = []
strategy.on_reset(lambda change: resets.append({"lost": [t.short for t in change.lost],
                                                "joined": [t.short for t in change.joined],
                                                "size": change.size}))
waited = []


@strategy.elastic
def train():
    for x, y in strategy.distribute_dataset(model.global_batches(0, args.steps, args.batch)):
        loss, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
        if first_process and me.short == args.die_task and opt.iterations == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if strategy.num_replicas_in_sync < args.wait_for and not waited:
            waited.append(True)
            for _ in range(150):      # every replica commits alike; the world grows at one of these
                strategy.commit()
                time.sleep(0.2)
        opt.apply_gradients([(grads[n], params[n]) for n in model.PARAM_NAMES])


train()
stem = os.path.join(args.out, f"{me.job}_{me.index}")
np.savez(stem + ".npz", **{name: var.numpy() for name, var in params.items()})
with open(stem + ".json", "w") as f:
    json.dump({"iterations": opt.iterations, "resets": resets, "replicas": strategy.num_replicas_in_sync,
               "restarted": not first_process}, f)
print(f"{me.short}: done, {opt.iterations} steps, {strategy.num_replicas_in_sync} replicas")
