"""Linear regression, the classic distributed-TensorFlow tutorial: learn W and b in y = 0.1 x + 0.3.

Every replica runs this same script (SPMD) under the ``mirrored`` strategy: W and b are mirrored
variables, each global batch is split over the replicas with ``strategy.distribute_dataset``, and
``opt.apply_gradients`` averages the replicas' gradients (weighted by their rows) before every one
of them applies the same SGD update. Run it on a local 2-process cluster, or alone (a world of one):

    stratagem launch --worker 2 -- python3 examples/linear_regression.py
    python3 examples/linear_regression.py --steps 100

With ``--ckpt DIR`` the chief writes a checkpoint there every ``--save-every`` steps and at the end
(``strategy.save``: every replica calls it, the chief writes), and a run that finds a checkpoint in
DIR resumes from it (``strategy.restore``: the chief reads it and sends the values to the others).
Run the same command twice to see the second run pick up where the first stopped:

    stratagem launch --worker 2 -- python3 examples/linear_regression.py --ckpt /tmp/linreg --steps 100
    stratagem launch --worker 2 -- python3 examples/linear_regression.py --ckpt /tmp/linreg --steps 200

The data is synthetic and seeded per step, so every replica builds the same global batches and a
resumed run sees the batches it would have seen without the interruption.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import stratagem
from stratagem.training.checkpoint import latest_checkpoint

TRUE_W, TRUE_B = 0.1, 0.3


def global_batch(step: int, batch_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of step ``step``: x uniform in [0, 1), y = 0.1 x + 0.3 (float32).

    Seeded by (seed, step), so every replica builds exactly the same batch, whatever step it starts at.
    """
    rng = np.random.default_rng([seed, step])
    x = rng.random(batch_size, dtype=np.float32)
    return x, (x * np.float32(TRUE_W) + np.float32(TRUE_B)).astype(np.float32)


def loss_and_grads(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Mean squared error over this replica's rows and its gradients with respect to W and b."""
    if len(x) == 0:  # more replicas than rows: this shard is empty and gets no weight
        return 0.0, np.zeros_like(w), np.zeros_like(b)
    error = w * x + b - y
    loss = float(np.mean(error * error))
    return loss, np.mean(2.0 * error * x, keepdims=True).astype(np.float32), \
        np.mean(2.0 * error, keepdims=True).astype(np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=201, help="train until this global step (default 201)")
    parser.add_argument("--batch", type=int, default=100, help="global batch size, split over the replicas")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="data and initial-value seed")
    parser.add_argument("--log-every", type=int, default=20, help="the chief prints a line every N steps")
    parser.add_argument("--ckpt", metavar="DIR", help="checkpoint directory: resume from it, save into it")
    parser.add_argument("--save-every", type=int, default=100, help="with --ckpt: save every N steps")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    args = parser.parse_args(argv)

    with stratagem.strategy("mirrored", transport=args.transport) as strategy:
        with strategy.scope():
            # Every replica creates the same variables; at the end of this block the chief's initial
            # values are copied to the others, so the seed could differ per replica.
            rng = np.random.default_rng(args.seed)
            w = stratagem.Variable(rng.uniform(-1.0, 1.0, 1).astype(np.float32), name="W")
            b = stratagem.Variable(np.zeros(1, np.float32), name="b")
            opt = stratagem.optimizers.SGD(learning_rate=args.lr)

        def say(text: str) -> None:
            if strategy.is_chief:
                print(text, flush=True)

        say(f"{strategy.num_replicas_in_sync} replica(s) over {args.transport}; global batch {args.batch}")
        start = 0
        if args.ckpt:
            # Only the chief looks at the directory (the others may not share its filesystem); the
            # answer reaches every replica through a reduce, so they all take the same branch.
            found = strategy.reduce("max", int(strategy.is_chief and latest_checkpoint(args.ckpt) is not None))
            if found:
                start = strategy.restore(args.ckpt)
                say(f"restored step {start} from {args.ckpt}: W = {w.numpy()[0]:.6f}, b = {b.numpy()[0]:.6f}")

        def train_step(x, y):
            loss, grad_w, grad_b = loss_and_grads(w.value, b.value, x, y)
            opt.apply_gradients([(grad_w, w), (grad_b, b)])   # all-reduce, then the same update everywhere
            return loss * len(x)                               # summed over rows: reduced below

        batches = (global_batch(step, args.batch, args.seed) for step in range(start, args.steps))
        for step, (x, y) in enumerate(strategy.distribute_dataset(batches), start=start + 1):
            weighted = strategy.run(train_step, args=(x, y))
            if step % args.log_every == 0 or step == args.steps:
                # Every replica takes part in the reduce (same steps everywhere); the chief prints.
                loss = strategy.reduce("sum", weighted) / args.batch
                say(f"step {step:5d}  loss {loss:.3e}  W {w.numpy()[0]: .6f}  b {b.numpy()[0]: .6f}")
            if args.ckpt and (step % args.save_every == 0 or step == args.steps):
                path = strategy.save(args.ckpt)
                say(f"saved {path}")
        say(f"final W = {w.numpy()[0]:.6f}, b = {b.numpy()[0]:.6f} (true: W = {TRUE_W}, b = {TRUE_B})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
