"""The digits MLP of mlp_digits.py in JAX (CPU): ``jax.grad`` computes, stratagem keeps the replicas in sync.

The parameters are a pytree (``{"hidden": {"w", "b"}, "out": {"w", "b"}}``) held as stratagem
Variables by ``stratagem.jax.TreeVariables``; each step hands JAX fresh arrays of the current values
and puts the gradient pytree from ``jax.grad`` through the strategy:

    grads = grad_fn(tree.values(), x, y)          # jax.jit(jax.grad(loss))
    tree.apply_gradients(opt, grads)              # all-reduce, then the same Adam update everywhere

Every replica runs this same script (SPMD) on its shard of each global batch. Run it on a local
2-process cluster, or alone:

    stratagem launch --worker 2 -- python3 examples/mlp_jax.py
    python3 examples/mlp_jax.py --epochs 5

Needs JAX (``pip install jax``; CPU is enough) and scikit-learn (for the data).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import stratagem


def initial_params(sizes: tuple[int, int, int], seed: int) -> dict:
    """He-initialised weights, zero biases (float32), as a nested dict: a pytree."""
    rng = np.random.default_rng(seed)
    n_in, n_hidden, n_out = sizes
    return {
        "hidden": {"w": (rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)).astype(np.float32),
                   "b": np.zeros(n_hidden, np.float32)},
        "out": {"w": (rng.standard_normal((n_hidden, n_out)) * np.sqrt(2.0 / n_hidden)).astype(np.float32),
                "b": np.zeros(n_out, np.float32)},
    }


def logits(params, x):
    import jax.numpy as jnp

    h = jnp.maximum(x @ params["hidden"]["w"] + params["hidden"]["b"], 0.0)
    return h @ params["out"]["w"] + params["out"]["b"]


def loss(params, x, y):
    """Mean softmax cross-entropy over the rows of ``x``."""
    import jax

    log_p = jax.nn.log_softmax(logits(params, x))
    return -log_p[np.arange(len(y)), y].mean()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    parser.add_argument("--batch", type=int, default=64, help="global batch size, split over the replicas")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="data split, shuffling and initial-value seed")
    parser.add_argument("--log-every", type=int, default=20, help="the chief prints the loss every N steps")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    args = parser.parse_args(argv)

    try:
        import jax
    except ImportError:
        raise SystemExit("this example needs JAX: pip install jax") from None
    import stratagem.jax

    # The data and its batches are the numpy example's (same split, same shuffling).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mlp_digits import epoch_batches, load_data

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    sizes = (x_train.shape[1], args.hidden, 10)
    steps_per_epoch = math.ceil(len(x_train) / args.batch)
    loss_and_grad = jax.jit(jax.value_and_grad(loss))

    with stratagem.strategy("mirrored", transport=args.transport) as strategy:
        with strategy.scope():
            tree = stratagem.jax.TreeVariables(initial_params(sizes, args.seed))
            opt = stratagem.optimizers.Adam(learning_rate=args.lr)

        def say(text: str) -> None:
            if strategy.is_chief:
                print(text, flush=True)

        def train_step(x, y) -> float:
            value, grads = loss_and_grad(tree.values(), x, y)
            tree.apply_gradients(opt, grads)   # an empty shard's NaN gradients weigh 0 in the mean
            return float(value) * len(y) if len(y) else 0.0

        def test_accuracy() -> float:
            (x, y), = strategy.distribute_dataset([(x_test, y_test)])
            predicted = np.asarray(logits(tree.values(), x)).argmax(axis=1)
            return strategy.reduce("sum", int(np.sum(predicted == y))) / len(x_test)

        say(f"digits in JAX {jax.__version__}: {len(x_train)} train / {len(x_test)} test images, MLP "
            f"{'-'.join(map(str, sizes))}, {strategy.num_replicas_in_sync} replica(s) over {args.transport}, "
            f"global batch {args.batch}, {steps_per_epoch} steps per epoch")
        started = time.perf_counter()
        step = 0
        for epoch in range(1, args.epochs + 1):
            summed, seen = 0.0, 0
            for x, y in strategy.distribute_dataset(epoch_batches(x_train, y_train, args.batch, epoch, args.seed)):
                summed += strategy.run(train_step, args=(x, y))
                seen += len(y)
                step += 1
                if step % args.log_every == 0:
                    total = strategy.reduce("sum", np.array([summed, seen], np.float64))
                    say(f"epoch {epoch:3d}  step {step:5d}  loss {total[0] / max(total[1], 1):.4f}")
                    summed, seen = 0.0, 0
            say(f"epoch {epoch:3d} done  step {step:5d}  test accuracy {test_accuracy():.3f}  "
                f"({time.perf_counter() - started:.2f}s)")
        say(f"final test accuracy {test_accuracy():.4f} after {step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
