"""One mirrored replica of the MLP in mirrored_model.py, run by ``stratagem launch`` (tests/test_mirrored.py).

    mirrored_train.py --out DIR --steps M [--batch B] [--optimizer sgd|adam] [--compression fp16]
                      [--ckpt DIR --save-at K] [--restore] [--die-at K --die-task worker:1]
                      [--crash-after-save] [--timeout S] [--peer-timeout S]

Each replica writes ``DIR/<job>_<index>.npz`` (final parameters) and ``DIR/<job>_<index>.json``
(first step, fingerprint after every step, losses). Non-chief replicas initialise their variables
from another seed: the chief's values must win. ``--die-at K``: the task ``--die-task`` SIGKILLs
itself in the middle of step K (gradients computed, not yet all-reduced); a survivor that gets
``PeerLostError`` writes ``DIR/<job>_<index>.error.json``, shuts down and exits 3. ``--crash-after-save``: the
last replica SIGKILLs itself in the step after the save (the job dies; the checkpoint must survive).
"""

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import mirrored_model as model
import stratagem

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--batch", type=int, default=25)
parser.add_argument("--optimizer", default="sgd")
parser.add_argument("--compression", default=None)
parser.add_argument("--ckpt")
parser.add_argument("--save-at", type=int)
parser.add_argument("--restore", action="store_true")
parser.add_argument("--die-at", type=int)
parser.add_argument("--die-task")
parser.add_argument("--crash-after-save", action="store_true")
parser.add_argument("--timeout", type=float, default=30.0)
parser.add_argument("--peer-timeout", type=float, default=5.0)
args = parser.parse_args()

# The launcher SIGTERMs the others as soon as one task fails; a survivor keeps going until its own
# PeerLostError so that the test sees what it reported (the launcher SIGKILLs it after --grace).
signal.signal(signal.SIGTERM, lambda *_: None)

strategy = stratagem.strategy(
    "mirrored", transport="zmq", compression=args.compression, timeout=args.timeout,
    transport_options={"timeout": args.timeout, "peer_timeout": args.peer_timeout},
)
me = strategy.task
stem = os.path.join(args.out, f"{me.job}_{me.index}")
rank = strategy.cluster.replicas().index(me)
with strategy.scope():
    params, opt = model.create(args.optimizer, seed=1 if strategy.is_chief else 100 + rank)

start = strategy.restore(args.ckpt) if args.restore else 0
record = {"task": me.short, "start": start, "fingerprints": [strategy.fingerprint()], "losses": []}
shards = strategy.distribute_dataset(model.global_batches(start, args.steps, args.batch))
crash_at = args.save_at + 1 if args.crash_after_save else None
last = f"worker:{strategy.num_replicas_in_sync - 1}"
step, began = start, time.monotonic()
try:
    for step, (x, y) in enumerate(shards, start=start):
        loss, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
        if (step == args.die_at and me.short == args.die_task) or (step == crash_at and me.short == last):
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.monotonic()
        opt.apply_gradients([(grads[n], params[n]) for n in model.PARAM_NAMES])
        record["losses"].append(strategy.reduce("mean", loss))
        record["fingerprints"].append(strategy.fingerprint())
        if args.save_at is not None and step + 1 == args.save_at:
            strategy.save(args.ckpt)
except stratagem.PeerLostError as exc:
    with open(stem + ".error.json", "w") as f:
        json.dump({"type": type(exc).__name__, "task": str(exc.task), "message": str(exc), "step": step,
                   "seconds": time.monotonic() - began}, f)
    print(f"{me.short}: {exc}", file=sys.stderr)
    strategy.shutdown()  # flushes what is queued, e.g. the notice telling the other survivors who died
    sys.exit(3)

np.savez(stem + ".npz", **{name: var.numpy() for name, var in params.items()})
with open(stem + ".json", "w") as f:
    json.dump({**record, "iterations": opt.iterations}, f)
strategy.shutdown()
