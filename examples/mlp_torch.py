"""The digits MLP of mlp_digits.py in PyTorch (CPU): torch computes and updates, stratagem keeps the replicas in sync.

The model is an ordinary ``torch.nn`` module (64-H-10, ReLU, cross-entropy) and the optimizer an
ordinary ``torch.optim.Adam``, wrapped by ``stratagem.torch.DistributedOptimizer``: the module's
parameters become views of stratagem Variables (no copies) and each step is plain torch:

    loss = F.cross_entropy(module(x), y); loss.backward()
    opt.step(); opt.zero_grad()        # mirrored: all-reduce the gradients, then torch's Adam everywhere

Every replica runs this same script (SPMD) on its shard of each global batch. Run it on a local
2-process cluster, alone, or on parameter servers (torch's Adam then runs on the ps tasks):

    stratagem launch --worker 2 -- python3 examples/mlp_torch.py
    python3 examples/mlp_torch.py --epochs 5
    stratagem launch --ps 1 --worker 2 -- python3 examples/mlp_torch.py --strategy between_graph

Needs PyTorch (CPU is enough) and scikit-learn (for the data). ``build_module`` is importable; so are
``mirror`` and ``train_step``, the same steps written by hand with a stratagem optimizer (what the
``in_graph`` strategy, which runs step functions on its replicas, needs; tests/test_in_graph.py and
tests/test_torch_equivalence.py use them).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import stratagem


def build_module(sizes: tuple[int, int, int], seed: int):
    """The torch MLP ``sizes[0] - sizes[1] (ReLU) - sizes[2]``, initialised by torch from ``seed``."""
    import torch

    torch.manual_seed(seed)
    n_in, n_hidden, n_out = sizes
    return torch.nn.Sequential(torch.nn.Linear(n_in, n_hidden), torch.nn.ReLU(), torch.nn.Linear(n_hidden, n_out))


def mirror(module) -> list[tuple[object, "stratagem.Variable"]]:
    """Make each parameter of ``module`` a view of a new stratagem Variable; call inside ``scope()``.
    (By hand, what ``stratagem.torch.wrap_module`` does.)

    Returns ``[(parameter, variable), ...]``. The variables take the module's current values (then, at
    the end of the scope, the chief's values, copied into the same buffers).
    """
    import torch

    pairs = []
    for name, param in module.named_parameters():
        var = stratagem.Variable(param.detach().numpy(), name=name)
        param.data = torch.from_numpy(var.value)     # shares the buffer: in-place updates show here
        pairs.append((param, var))
    return pairs


def train_step(module, pairs, opt, x, y) -> float:
    """One step on this replica's rows: forward, backward, ``apply_gradients``; returns the mean loss."""
    import torch
    import torch.nn.functional as F

    if len(x) == 0:  # more replicas than rows: an empty shard takes part with zero gradients
        opt.apply_gradients([(np.zeros(var.shape, var.dtype), var) for _, var in pairs])
        return 0.0
    loss = F.cross_entropy(module(torch.as_tensor(x)), torch.as_tensor(y))
    loss.backward()
    opt.apply_gradients([(param.grad.numpy(), var) for param, var in pairs])
    module.zero_grad(set_to_none=True)
    return float(loss.detach())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set (default 10)")
    parser.add_argument("--batch", type=int, default=64, help="global batch size, split over the replicas")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (default 64)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="data split, shuffling and initial-value seed")
    parser.add_argument("--log-every", type=int, default=20, help="the chief prints the loss every N steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per replica (default 1: replicas on one machine share its cores)")
    parser.add_argument("--strategy", choices=("mirrored", "between_graph"), default="mirrored",
                        help="mirrored (default), or between_graph (sync) with --ps tasks")
    parser.add_argument("--transport", default=os.environ.get("STRATAGEM_TRANSPORT", "zmq"))
    args = parser.parse_args(argv)

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        raise SystemExit("this example needs PyTorch: pip install torch") from None
    import stratagem.torch

    # The data and its batches are the numpy example's (same split, same shuffling).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mlp_digits import epoch_batches, load_data

    torch.set_num_threads(args.threads)
    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    sizes = (x_train.shape[1], args.hidden, 10)
    steps_per_epoch = math.ceil(len(x_train) / args.batch)
    options = {"mode": "sync"} if args.strategy == "between_graph" else {}

    # On a ps task (between_graph) this line serves the variables until training ends, then exits.
    with stratagem.strategy(args.strategy, transport=args.transport, **options) as strategy:
        module = build_module(sizes, args.seed)
        opt = stratagem.torch.DistributedOptimizer(torch.optim.Adam(module.parameters(), lr=args.lr),
                                                   module.named_parameters(), strategy=strategy)

        def say(text: str) -> None:
            if strategy.is_chief:
                print(text, flush=True)

        def train_step(x, y) -> float:
            loss = F.cross_entropy(module(torch.as_tensor(x)), torch.as_tensor(y))
            loss.backward()            # an empty shard's NaN gradients weigh 0 in the mean
            opt.step()
            opt.zero_grad()
            return float(loss.detach()) * len(y) if len(y) else 0.0

        def test_accuracy() -> float:
            (x, y), = strategy.distribute_dataset([(x_test, y_test)])
            with torch.no_grad():
                predicted = module(torch.as_tensor(x)).argmax(dim=1).numpy()
            return strategy.reduce("sum", int(np.sum(predicted == y))) / len(x_test)

        say(f"digits in PyTorch {torch.__version__}: {len(x_train)} train / {len(x_test)} test images, MLP "
            f"{'-'.join(map(str, sizes))}, {len(strategy.cluster.replicas())} replica(s) over {args.transport} "
            f"({args.strategy}), global batch {args.batch}, {steps_per_epoch} steps per epoch")
        started = time.perf_counter()
        step = 0
        for epoch in range(1, args.epochs + 1):
            summed, seen = 0.0, 0
            for x, y in strategy.distribute_dataset(epoch_batches(x_train, y_train, args.batch, epoch, args.seed)):
                summed += strategy.run(train_step, args=(x, y))
                seen += len(y)
                step += 1
                if step % args.log_every == 0:
                    loss = strategy.reduce("sum", np.array([summed, seen], np.float64))
                    say(f"epoch {epoch:3d}  step {step:5d}  loss {loss[0] / max(loss[1], 1):.4f}")
                    summed, seen = 0.0, 0
            say(f"epoch {epoch:3d} done  step {step:5d}  test accuracy {test_accuracy():.3f}  "
                f"({time.perf_counter() - started:.2f}s)")
        say(f"final test accuracy {test_accuracy():.4f} after {step} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
