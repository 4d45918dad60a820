"""One mirrored replica of mirrored_model.py over a chosen transport (tests/test_multihost.py).

    multihost_mirrored.py --out DIR --steps M --batch B --transport zmq|grpc

Writes ``DIR/<job>_<index>.npz`` (final parameters). Non-chief replicas start from another seed: the
chief's initial values must win.
"""

import argparse
import os

import numpy as np

import mirrored_model as model
import stratagem

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--batch", type=int, default=24)
parser.add_argument("--transport", default="zmq")
parser.add_argument("--timeout", type=float, default=30.0)
args = parser.parse_args()

strategy = stratagem.strategy("mirrored", transport=args.transport, timeout=args.timeout,
                              transport_options={"timeout": args.timeout})
me = strategy.task
rank = strategy.cluster.replicas().index(me)
with strategy.scope():
    params, opt = model.create("sgd", seed=1 if strategy.is_chief else 100 + rank)
for x, y in strategy.distribute_dataset(model.global_batches(0, args.steps, args.batch)):
    loss, grads = model.loss_and_grads({n: v.value for n, v in params.items()}, x, y)
    opt.apply_gradients([(grads[n], params[n]) for n in model.PARAM_NAMES])
np.savez(os.path.join(args.out, f"{me.job}_{me.index}.npz"), **{n: v.numpy() for n, v in params.items()})
strategy.shutdown()
