"""Embedding tables on parameter servers: matrix factorisation of synthetic ratings, moving rows only.

Every task runs this same script. Two tables, one row per user and one per item (by default 50,000 x
16 and 20,000 x 16 float32: 4.5 MB), are split across the ``ps`` tasks. Each worker step reads just
the rows its batch names (``table.gather(ids)``), computes the rating prediction ``<u, v>`` and the
squared error, and pushes the gradients of those rows (``stratagem.IndexedSlices``); the ps tasks
update just those rows with Adagrad (bit for bit the dense update: ``optimizer.sparse_exact``). A
step moves kilobytes, not the tables:

    stratagem launch --ps 2 --worker 2 -- python3 examples/embedding_ps.py
    stratagem launch --ps 2 --worker 2 -- python3 examples/embedding_ps.py --mode sync --steps 400

The ratings come from hidden factors of rank ``--rank`` (a fixed seed), so the error falls as the
tables learn them. The chief prints the loss, the bytes this worker moved per step (measured by the
transport) against the tables' size, and stops the job at ``--steps`` global steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import stratagem


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("async", "sync", "bounded"), default="async")
    parser.add_argument("--users", type=int, default=50_000)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    parser.add_argument("--rank", type=int, default=4, help="rank of the hidden factors (default 4)")
    parser.add_argument("--batch", type=int, default=256, help="ratings per worker step (default 256)")
    parser.add_argument("--steps", type=int, default=600, help="stop at this global step (default 600)")
    parser.add_argument("--lr", type=float, default=0.5, help="Adagrad learning rate (default 0.5)")
    parser.add_argument("--log-every", type=int, default=100, help="the chief prints every N global steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any request may wait")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    return parser.parse_args(argv)


class Ratings:
    """Synthetic ratings ``<f_user, f_item>`` of hidden rank-``rank`` factors; popular ids come more often."""

    def __init__(self, users: int, items: int, rank: int, seed: int):
        rng = np.random.default_rng(seed)
        self.users, self.items = users, items
        self.user_factors = rng.normal(0, 1, (users, rank)).astype(np.float32)
        self.item_factors = rng.normal(0, 1, (items, rank)).astype(np.float32)

    def batch(self, seed: int, task: int, step: int, size: int):
        rng = np.random.default_rng([seed, task, step])
        users = np.minimum(rng.zipf(1.3, size) - 1, self.users - 1)
        items = np.minimum(rng.zipf(1.3, size) - 1, self.items - 1)
        ratings = np.einsum("ij,ij->i", self.user_factors[users], self.item_factors[items])
        return users, items, ratings.astype(np.float32)


def loss_and_grads(u, v, ratings):
    """Mean squared error of ``<u, v>`` and its gradients with respect to the rows ``u`` and ``v``."""
    error = np.einsum("ij,ij->i", u, v) - ratings
    scale = (2.0 / len(ratings)) * error[:, None]
    return float(np.mean(error * error)), (scale * v).astype(np.float32), (scale * u).astype(np.float32)


def main(argv=None) -> int:
    args = parse_args(argv)
    data = Ratings(args.users, args.items, args.rank, args.seed)
    options = {"mode": args.mode, "partition_bytes": 1 << 20, "transport_options": {"timeout": args.timeout}}
    if args.mode == "bounded":
        options["staleness"] = 2
    # On a ps task this call serves the tables until training ends, then exits the process.
    with stratagem.strategy("between_graph", transport=args.transport, **options) as strategy:
        with strategy.scope():
            rng = np.random.default_rng(args.seed + 1)
            users = stratagem.Variable(rng.normal(0, 0.1, (args.users, args.dim)).astype(np.float32), name="users")
            items = stratagem.Variable(rng.normal(0, 0.1, (args.items, args.dim)).astype(np.float32), name="items")
            opt = stratagem.optimizers.Adagrad(learning_rate=args.lr)
        table_bytes = users.value.nbytes + items.value.nbytes     # read once, before training: a dense pull

        def train_step(user_ids, item_ids, ratings):
            u, v = users.gather(user_ids), items.gather(item_ids)   # only these rows come from the ps tasks
            loss, grad_u, grad_v = loss_and_grads(u, v, ratings)
            opt.apply_gradients([(stratagem.IndexedSlices(grad_u, user_ids, users.shape), users),
                                 (stratagem.IndexedSlices(grad_v, item_ids, items.shape), items)])
            return loss

        me, local_step, logged, losses = strategy.task.index, 0, 0, []
        before = strategy.transport.traffic.snapshot()
        if strategy.is_chief:
            print(f"{len(strategy.cluster.tasks('ps'))} ps, {len(strategy.cluster.replicas())} worker(s), mode "
                  f"{args.mode}; tables {args.users} + {args.items} rows x {args.dim} = {table_bytes / 1e6:.1f} MB",
                  flush=True)
        while not strategy.should_stop():
            losses.append(strategy.run(train_step, args=data.batch(args.seed, me, local_step, args.batch)))
            local_step += 1
            step = strategy.global_step
            if not strategy.is_chief:
                continue
            if step // args.log_every > logged or step >= args.steps:
                logged = step // args.log_every
                moved = strategy.transport.traffic.snapshot() - before
                per_step = (moved.sent_bytes() + moved.received_bytes()) / local_step
                print(f"global step {step:5d}  loss {np.mean(losses[-20:]):.4f}  moved {per_step / 1e3:.1f} KB "
                      f"per step ({per_step / table_bytes:.2%} of the tables)", flush=True)
            if step >= args.steps:
                strategy.request_stop()   # every worker's should_stop() turns true
        if strategy.is_chief:
            print(f"first loss {np.mean(losses[:20]):.4f}, last loss {np.mean(losses[-20:]):.4f}; this worker ran "
                  f"{local_step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
