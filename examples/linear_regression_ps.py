"""Linear regression on parameter servers: the classic between-graph ``dist_tf.py``, y = 0.1 x + 0.3.

Every task runs this same script. The ``ps`` tasks hold W and b (placed round-robin, so W lives on
``ps:0`` and b on ``ps:1``) and run the SGD updates; they serve from inside ``stratagem.strategy(...)``
and exit when training ends. Every worker draws its own batches of 100 points and trains against
them; the chief initialises the variables, decides when to stop (when the global step reaches
``--steps``) and writes the checkpoints:

    stratagem launch --ps 2 --worker 3 -- python3 examples/linear_regression_ps.py --mode async
    stratagem launch --ps 2 --worker 3 -- python3 examples/linear_regression_ps.py --mode sync
    stratagem launch --ps 2 --worker 3 -- python3 examples/linear_regression_ps.py --mode bounded --staleness 2

``--mode async``: each worker's update is applied as it arrives (TF1's default). ``--mode sync``: each
update averages the gradients of ``--replicas-to-aggregate`` workers (default all) for the same step;
with fewer than all, the slowest workers are backups and their stale gradients are dropped.
``--mode bounded``: like async, but no worker runs more than ``--staleness`` steps ahead of the slowest.

With ``--ckpt DIR`` the chief saves every ``--save-every`` global steps and at the end; a job that finds
a checkpoint there resumes from it (the chief restores it onto the ps tasks before any worker starts):

    stratagem launch --ps 2 --worker 3 -- python3 examples/linear_regression_ps.py --ckpt /tmp/lr_ps --steps 500
    stratagem launch --ps 2 --worker 3 -- python3 examples/linear_regression_ps.py --ckpt /tmp/lr_ps --steps 1000
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import stratagem

TRUE_W, TRUE_B = 0.1, 0.3


def batch(seed: int, task: int, step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This worker's batch of its local step ``step``: x uniform in [0, 1), y = 0.1 x + 0.3."""
    rng = np.random.default_rng([seed, task, step])
    x = rng.random(size, dtype=np.float32)
    return x, (x * np.float32(TRUE_W) + np.float32(TRUE_B)).astype(np.float32)


def loss_and_grads(w, b, x, y):
    """Mean squared error and its gradients with respect to W and b."""
    error = w * x + b - y
    return float(np.mean(error * error)), np.mean(2.0 * error * x, keepdims=True).astype(np.float32), \
        np.mean(2.0 * error, keepdims=True).astype(np.float32)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("async", "sync", "bounded"), default="async")
    parser.add_argument("--steps", type=int, default=1000, help="stop at this global step (default 1000)")
    parser.add_argument("--batch", type=int, default=100, help="points per worker batch (default 100)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    parser.add_argument("--staleness", type=int, default=2, help="with --mode bounded (default 2)")
    parser.add_argument("--replicas-to-aggregate", type=int, help="with --mode sync (default: all workers)")
    parser.add_argument("--placement", choices=("round_robin", "greedy"), default="round_robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=200, help="the chief prints every N global steps")
    parser.add_argument("--ckpt", metavar="DIR", help="checkpoint directory: resume from it, save into it")
    parser.add_argument("--save-every", type=int, default=500, help="with --ckpt: save every N global steps")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any request may wait")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    options = {"mode": args.mode, "placement": args.placement, "checkpoint_dir": args.ckpt,
               "transport_options": {"timeout": args.timeout}}
    if args.mode == "bounded":
        options["staleness"] = args.staleness
    if args.mode == "sync" and args.replicas_to_aggregate:
        options["replicas_to_aggregate"] = args.replicas_to_aggregate
    # On a ps task this call serves W and b until training ends, then exits the process.
    with stratagem.strategy("between_graph", transport=args.transport, **options) as strategy:
        with strategy.scope():
            rng = np.random.default_rng(args.seed)
            w = stratagem.Variable(rng.uniform(-1.0, 1.0, 1).astype(np.float32), name="W")   # on ps:0
            b = stratagem.Variable(np.zeros(1, np.float32), name="b")                      # on ps:1
            opt = stratagem.optimizers.SGD(learning_rate=args.lr)
        # Here the chief has initialised W and b (or restored them); the other workers waited for it.

        def say(text: str) -> None:
            if strategy.is_chief:
                print(text, flush=True)

        start = strategy.global_step
        say(f"{len(strategy.cluster.tasks('ps'))} ps, {len(strategy.cluster.replicas())} worker(s), "
            f"mode {args.mode}, starting at global step {start}")
        me, local_step, logged, saved = strategy.task.index, 0, start // args.log_every, start // args.save_every

        def train_step(x, y):
            loss, grad_w, grad_b = loss_and_grads(w.value, b.value, x, y)   # reads pull fresh W, b
            opt.apply_gradients([(grad_w, w), (grad_b, b)])                  # the ps tasks apply SGD
            return loss

        while not strategy.should_stop():
            loss = strategy.run(train_step, args=batch(args.seed, me, local_step, args.batch))
            local_step += 1
            step = strategy.global_step
            if not strategy.is_chief:
                continue
            if step // args.log_every > logged or step >= args.steps:
                logged = step // args.log_every
                say(f"global step {step:5d}  loss {loss:.3e}  W {w.numpy()[0]: .6f}  b {b.numpy()[0]: .6f}")
            if args.ckpt and (step // args.save_every > saved or step >= args.steps):
                saved = step // args.save_every
                say(f"saved {strategy.save(args.ckpt)}")
            if step >= args.steps:
                strategy.request_stop()   # every worker's should_stop() turns true
        say(f"final W = {w.numpy()[0]:.6f}, b = {b.numpy()[0]:.6f} (true: W = {TRUE_W}, b = {TRUE_B}); "
            f"this worker ran {local_step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
