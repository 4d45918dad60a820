"""The digits MLP of mlp_digits.py under ``in_graph``: one client splits every batch over the replicas.

The client (the chief task) holds the model and the data. Each ``strategy.run(train_step, args=(x, y))``
splits the global batch over the replicas, each computes the gradients of its rows (numpy, by hand),
and the client applies one Adam update with their row-weighted sum: the update one process makes on
the whole batch. The replicas are the client's own devices (``--devices N``: N CPU threads) and every
other task of the cluster:

    stratagem launch --worker 3 -- python3 examples/mlp_in_graph.py     # the client + 2 worker tasks
    python3 examples/mlp_in_graph.py --devices 2                         # 2 replicas in one process

Every task runs this script. On a worker task ``stratagem.strategy("in_graph", ...)`` serves the
client's steps and exits when the client is done; the workers find ``train_step`` and ``count_correct``
by name, importing their own copy of this script, which is why the training sits under the main guard
(the variables and step functions stay at the top level, where every copy of the script creates them).

Needs scikit-learn (``pip install scikit-learn``) for the data.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import stratagem
from mlp_digits import PARAM_NAMES, epoch_batches, forward, initial_params, load_data, loss_and_grads

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
parser.add_argument("--batch", type=int, default=64, help="global batch size, split over the replicas")
parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
parser.add_argument("--seed", type=int, default=0, help="data split, shuffling and initial-value seed")
parser.add_argument("--devices", type=int, default=1, help="the client's own CPU replicas (default 1)")
parser.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
args = parser.parse_args()

SIZES = (64, args.hidden, 10)        # the digits are 8x8 images, in 10 classes

strategy = stratagem.strategy("in_graph", transport=args.transport, devices=args.devices)
with strategy.scope():                # on the client: the variables; on a replica: its copies of them
    variables = {name: stratagem.Variable(value, name=name)
                 for name, value in initial_params(SIZES, args.seed).items()}
    opt = stratagem.optimizers.Adam(learning_rate=args.lr)


def train_step(x, y):
    """One replica's rows: the gradients of their mean loss, handed to the optimizer."""
    loss, grads = loss_and_grads({name: var.value for name, var in variables.items()}, x, y)
    opt.apply_gradients([(grads[name], variables[name]) for name in PARAM_NAMES])
    return loss


def count_correct(x, y):
    logits, _ = forward({name: var.value for name, var in variables.items()}, x)
    return int(np.sum(np.argmax(logits, axis=1) == y))


def main() -> int:
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    steps_per_epoch = math.ceil(len(x_train) / args.batch)

    def test_accuracy() -> float:
        # The test set is one batch: split over the replicas, the correct answers summed.
        return strategy.reduce("sum", strategy.run(count_correct, args=(x_test, y_test))) / len(x_test)

    with strategy:                    # at the end (or on an error) the worker tasks are told to exit
        print(f"digits: {len(x_train)} train / {len(x_test)} test images, MLP {'-'.join(map(str, SIZES))}, "
              f"{strategy.num_replicas_in_sync} replica(s) over {args.transport}, global batch {args.batch}, "
              f"{steps_per_epoch} steps per epoch", flush=True)
        started = time.perf_counter()
        step, accuracy = 0, test_accuracy()
        print(f"before training: test accuracy {accuracy:.3f}", flush=True)
        for epoch in range(1, args.epochs + 1):
            summed, seen = 0.0, 0
            for x, y in epoch_batches(x_train, y_train, args.batch, epoch, args.seed):
                # the mean loss over the batch's rows (the replicas' losses weighted by their rows)
                summed += strategy.reduce("mean", strategy.run(train_step, args=(x, y))) * len(y)
                seen += len(y)
                step += 1
                if step % args.log_every == 0:
                    print(f"epoch {epoch:3d}  step {step:5d}  loss {summed / seen:.4f}", flush=True)
                    summed, seen = 0.0, 0
            accuracy = test_accuracy()
            print(f"epoch {epoch:3d} done  step {step:5d}  test accuracy {accuracy:.3f}  "
                  f"({time.perf_counter() - started:.2f}s)", flush=True)
        print(f"final test accuracy {accuracy:.4f} after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
