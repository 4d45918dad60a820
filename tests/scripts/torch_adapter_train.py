"""A torch MLP trained through stratagem.torch, for tests/test_torch_adapter.py.

    torch_adapter_train.py --out DIR --strategy mirrored|between_graph --optimizer adam|sgd|adagrad|rmsprop
                           --steps M [--first K] [--save DIR] [--restore DIR]     one task (under ``launch``)
    torch_adapter_train.py --out DIR --optimizer adam,sgd,... --steps M --reference  one process, plain torch

A replica builds the module (non-chief replicas from another seed: the chief's values must win),
wraps its torch optimizer in ``stratagem.torch.DistributedOptimizer`` and trains global steps
``--first`` .. ``--steps`` on its shard of each global batch (``strategy.distribute_dataset``):
``loss.backward(); opt.step(); opt.zero_grad()``. ``--restore DIR`` restores the latest checkpoint
first (``between_graph``: ``checkpoint_dir=DIR``), ``--save DIR`` saves one at the end (``strategy.save``). It writes ``DIR/<job>_<index>.npz``
(final parameters by name) and ``.json`` (rows of its first shard, what ``broadcast_parameters`` gave
it). ``--reference`` trains the same module alone on whole batches with plain ``torch.optim``, once per
optimizer named, into ``DIR/<optimizer>/``.
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

SIZES = (20, 16, 5)
NUM_EXAMPLES = 200
BATCH = 25          # divides by neither 2 nor 3: unequal shards, weighted by their rows


def build_module(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                               torch.nn.Linear(SIZES[1], SIZES[2]))


def make_optimizer(kind: str, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, lr_decay=0.01)
    if kind == "rmsprop":
        return torch.optim.RMSprop(params, lr=0.005, momentum=0.5)
    raise SystemExit(f"unknown optimizer {kind}")


def global_batches(first: int, steps: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_EXAMPLES, SIZES[0])).astype(np.float32)
    # Features of very different scales: some gradients are tiny, where Adam's epsilon placement shows.
    x *= np.logspace(-4, 0, SIZES[0], dtype=np.float32)
    y = np.argmax(x @ rng.standard_normal((SIZES[0], SIZES[2])).astype(np.float32), axis=1).astype(np.int64)
    for step in range(first, steps):
        rows = (np.arange(BATCH) + step * BATCH) % NUM_EXAMPLES
        yield x[rows], y[rows]


def save(path: str, arrays: dict) -> None:
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)


def reference(args) -> None:
    """For each of the comma-separated ``--optimizer`` s: ``DIR/<optimizer>/initial.npz`` and ``reference.npz``."""
    for kind in args.optimizer.split(","):
        out = os.path.join(args.out, kind)
        os.makedirs(out, exist_ok=True)
        module = build_module(seed=1)
        save(os.path.join(out, "initial.npz"), {n: p.detach().numpy().copy() for n, p in module.named_parameters()})
        opt = make_optimizer(kind, module.parameters())
        for x, y in global_batches(0, args.steps):
            F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            opt.step()
            opt.zero_grad()
        save(os.path.join(out, "reference.npz"), {n: p.detach().numpy() for n, p in module.named_parameters()})


def task(args) -> None:
    import stratagem
    import stratagem.torch

    options = {"mode": "sync"} if args.strategy == "between_graph" else {}
    if args.restore and args.strategy == "between_graph":
        options["checkpoint_dir"] = args.restore     # the chief restores it before anyone starts
    strategy = stratagem.strategy(args.strategy, transport="zmq", timeout=60, **options)  # ps tasks serve here
    rank = strategy.cluster.replicas().index(strategy.task)
    module = build_module(seed=1 if strategy.is_chief else 100 + rank)
    opt = stratagem.torch.DistributedOptimizer(make_optimizer(args.optimizer, module.parameters()),
                                               module.named_parameters(), strategy=strategy)
    if args.restore and args.strategy == "mirrored":
        strategy.restore(args.restore)
    rows = []
    for x, y in strategy.distribute_dataset(global_batches(args.first, args.steps)):
        F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        opt.zero_grad()
        rows.append(len(y))
    if args.save:
        strategy.save(args.save)
    # No copies: every parameter is a view of its variable's buffer.
    for name, param in module.named_parameters():
        assert np.shares_memory(param.detach().numpy(), opt.variables[name].value), name
    final = {name: param.detach().numpy().copy() for name, param in module.named_parameters()}
    # broadcast_parameters: the last replica's tensor reaches everyone, in place.
    size = len(strategy.cluster.replicas())
    probe = {"probe": torch.full((3,), float(rank))}
    stratagem.torch.broadcast_parameters(probe, root=size - 1, strategy=strategy)
    me = strategy.task
    stem = os.path.join(args.out, f"{me.job}_{me.index}")
    save(stem + ".npz", final)
    with open(stem + ".json", "w") as f:
        json.dump({"rows": rows, "broadcast": probe["probe"].tolist(), "replicas": size}, f)
    strategy.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="mirrored")
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--save")
    parser.add_argument("--restore")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    (reference if args.reference else task)(args)


if __name__ == "__main__":
    main()
