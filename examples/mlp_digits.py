"""An MLP classifier for handwritten digits, in plain numpy, trained with Adam under ``mirrored``.

The data is scikit-learn's bundled digits dataset (1797 8x8 grey images of the digits 0-9; it ships
with the package, nothing is downloaded): 80% to train, 20% held out for the test accuracy. The model
is 64-H-10 (ReLU, softmax cross-entropy) with the forward and backward passes written by hand.

Every replica runs this same script (SPMD): the variables are mirrored, each global batch is split
over the replicas (``strategy.distribute_dataset``) and ``opt.apply_gradients`` all-reduces the
gradients before every replica applies the same Adam update. The test set is split too, and the
correct answers are summed over the replicas. Run it on a local 2-process cluster, or alone:

    stratagem launch --worker 2 -- python3 examples/mlp_digits.py
    python3 examples/mlp_digits.py --epochs 5

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

PARAM_NAMES = ("w1", "b1", "w2", "b2")


def load_data(seed: int, test_fraction: float = 0.2):
    """``(x_train, y_train), (x_test, y_test)``: pixels scaled to [0, 1] (float32), a seeded split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("this example needs scikit-learn for its data: pip install scikit-learn") from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def initial_params(sizes: tuple[int, int, int], seed: int) -> dict[str, np.ndarray]:
    """He-initialised weights, zero biases (float32)."""
    rng = np.random.default_rng(seed)
    n_in, n_hidden, n_out = sizes
    return {
        "w1": (rng.standard_normal((n_in, n_hidden)) * np.sqrt(2.0 / n_in)).astype(np.float32),
        "b1": np.zeros(n_hidden, np.float32),
        "w2": (rng.standard_normal((n_hidden, n_out)) * np.sqrt(2.0 / n_hidden)).astype(np.float32),
        "b2": np.zeros(n_out, np.float32),
    }


def forward(params: dict, x: np.ndarray):
    """Logits and the hidden activations (kept for the backward pass)."""
    h = np.maximum(x @ params["w1"] + params["b1"], 0.0)
    return h @ params["w2"] + params["b2"], h


def loss_and_grads(params: dict, x: np.ndarray, y: np.ndarray):
    """Mean softmax cross-entropy over the rows of ``x`` and its gradients (zeros for an empty shard)."""
    n = len(x)
    if n == 0:
        return 0.0, {name: np.zeros_like(params[name]) for name in PARAM_NAMES}
    logits, h = forward(params, x)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    loss = float(-np.mean(np.log(np.maximum(p[rows, y], 1e-30))))
    d_logits = p                                  # d loss / d logits = (softmax - one_hot) / n
    d_logits[rows, y] -= 1.0
    d_logits /= np.float32(n)
    d_h = (d_logits @ params["w2"].T) * (h > 0)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(axis=0), "w2": h.T @ d_logits, "b2": d_logits.sum(axis=0)}
    return loss, {name: g.astype(np.float32, copy=False) for name, g in grads.items()}


def epoch_batches(x: np.ndarray, y: np.ndarray, batch_size: int, epoch: int, seed: int):
    """The global batches of one epoch, shuffled with a seed every replica shares."""
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    for start in range(0, len(x), batch_size):
        rows = order[start:start + batch_size]
        yield x[rows], y[rows]


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

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    sizes = (x_train.shape[1], args.hidden, 10)
    steps_per_epoch = math.ceil(len(x_train) / args.batch)

    with stratagem.strategy("mirrored", transport=args.transport) as strategy:
        with strategy.scope():
            variables = {name: stratagem.Variable(value, name=name)
                         for name, value in initial_params(sizes, args.seed).items()}
            opt = stratagem.optimizers.Adam(learning_rate=args.lr)

        def say(text: str) -> None:
            if strategy.is_chief:
                print(text, flush=True)

        def train_step(x, y):
            params = {name: var.value for name, var in variables.items()}
            loss, grads = loss_and_grads(params, x, y)
            opt.apply_gradients([(grads[name], variables[name]) for name in PARAM_NAMES])
            return loss * len(x)

        def test_accuracy() -> float:
            # One global batch: the test set, split over the replicas; correct answers summed.
            (x, y), = strategy.distribute_dataset([(x_test, y_test)])
            logits, _ = forward({name: var.value for name, var in variables.items()}, x)
            correct = int(np.sum(np.argmax(logits, axis=1) == y))
            return strategy.reduce("sum", correct) / len(x_test)

        say(f"digits: {len(x_train)} train / {len(x_test)} test images, MLP {'-'.join(map(str, sizes))}, "
            f"{strategy.num_replicas_in_sync} replica(s) over {args.transport}, global batch {args.batch}, "
            f"{steps_per_epoch} steps per epoch")
        started = time.perf_counter()
        step, accuracy = 0, test_accuracy()
        say(f"before training: test accuracy {accuracy:.3f}")
        for epoch in range(1, args.epochs + 1):
            batches = epoch_batches(x_train, y_train, args.batch, epoch, args.seed)
            summed, seen = 0.0, 0
            for x, y in strategy.distribute_dataset(batches):
                summed += strategy.run(train_step, args=(x, y))
                seen += len(y)
                step += 1
                if step % args.log_every == 0:
                    # The loss of the last batches since the previous line, averaged over every replica's rows.
                    loss = strategy.reduce("sum", np.array([summed, seen], np.float64))
                    say(f"epoch {epoch:3d}  step {step:5d}  loss {loss[0] / max(loss[1], 1):.4f}")
                    summed, seen = 0.0, 0
            accuracy = test_accuracy()
            say(f"epoch {epoch:3d} done  step {step:5d}  test accuracy {accuracy:.3f}  "
                f"({time.perf_counter() - started:.2f}s)")
        say(f"final test accuracy {accuracy:.4f} after {step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
