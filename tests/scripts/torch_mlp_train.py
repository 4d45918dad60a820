"""The PyTorch MLP of examples/mlp_torch.py trained with SGD, for tests/test_torch_equivalence.py.

    torch_mlp_train.py --out DIR --steps M --batch B            one mirrored replica (under ``launch``)
    torch_mlp_train.py --out DIR --steps M --batch B --reference    one process, plain PyTorch

A replica trains the example's module (``build_module`` / ``mirror`` / ``train_step``) with
stratagem's SGD on its shard of every global batch and writes ``DIR/<job>_<index>.npz`` (its final
parameters, by name) and ``DIR/<job>_<index>.json`` (fingerprint after every step, losses). Non-chief
replicas initialise the module from another seed: the chief's values must win.

``--reference`` trains the same module in this process alone, on whole global batches, with
``torch.optim.SGD`` and no stratagem at all, and writes ``DIR/reference.npz`` (and the initial
parameters, ``DIR/initial.npz``).
"""

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mlp_torch import build_module, mirror, train_step  # noqa: E402

SIZES = (64, 32, 10)
NUM_EXAMPLES = 300
LR, MOMENTUM = 0.1, 0.9


def dataset(seed: int = 0):
    """Synthetic classification data: labels from a random linear teacher (float32 inputs)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NUM_EXAMPLES, SIZES[0])).astype(np.float32)
    teacher = rng.standard_normal((SIZES[0], SIZES[2])).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1).astype(np.int64)


def global_batches(steps: int, batch: int):
    x, y = dataset()
    for step in range(steps):
        rows = (np.arange(batch) + step * batch) % len(x)
        yield x[rows], y[rows]


def save(path: str, arrays: dict) -> None:
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)


def reference(args) -> None:
    module = build_module(SIZES, seed=1)
    save(os.path.join(args.out, "initial.npz"), {name: p.detach().numpy() for name, p in module.named_parameters()})
    opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in global_batches(args.steps, args.batch):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    save(os.path.join(args.out, "reference.npz"),
         {name: p.detach().numpy() for name, p in module.named_parameters()})


def replica(args) -> None:
    import stratagem

    with stratagem.strategy("mirrored", transport="zmq", timeout=60) as strategy:
        me = strategy.task
        rank = strategy.cluster.replicas().index(me)
        module = build_module(SIZES, seed=1 if strategy.is_chief else 100 + rank)
        with strategy.scope():
            pairs = mirror(module)
            opt = stratagem.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        prints, losses, rows = [strategy.fingerprint()], [], []
        for x, y in strategy.distribute_dataset(global_batches(args.steps, args.batch)):
            losses.append(train_step(module, pairs, opt, x, y))
            rows.append(len(y))
            prints.append(strategy.fingerprint())
        # The module computes with the variables' buffers: what it holds is what the variables hold.
        for param, var in pairs:
            assert np.shares_memory(param.detach().numpy(), var.value), var.name
        stem = os.path.join(args.out, f"{me.job}_{me.index}")
        save(stem + ".npz", {var.name: var.numpy() for _, var in pairs})
        with open(stem + ".json", "w") as f:
            json.dump({"fingerprints": prints, "losses": losses, "rows": rows,
                       "replicas": strategy.num_replicas_in_sync, "iterations": opt.iterations}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    (reference if args.reference else replica)(args)


if __name__ == "__main__":
    main()
