"""A JAX MLP trained through stratagem.jax, for tests/test_jax_adapter.py.

    jax_adapter_train.py --out DIR --strategy mirrored|between_graph --update adam|own --steps M   one task
    jax_adapter_train.py --out DIR --update adam|own --steps M --reference              one process, plain JAX

``--update adam``: the gradient pytree from ``jax.grad`` goes to ``tree.apply_gradients`` with
stratagem's Adam (the strategy reduces and applies). ``--update own``: ``tree.reduce_gradients`` gives
the replicas' mean gradient pytree and the script applies its own momentum update in jax.numpy (what
an optax user does). Non-chief replicas start from another seed: the chief's values must win.
``--reference`` trains alone on whole global batches in plain JAX, with the same rules written in
jax.numpy (TF's Adam, as stratagem's). Each writes ``DIR/<job>_<index>.npz`` / ``DIR/reference.npz``.
"""

import argparse
import json
import math
import os

import numpy as np

import jax
import jax.numpy as jnp

SIZES = (12, 16, 4)
NUM_EXAMPLES = 150
BATCH = 25
LR, BETA_1, BETA_2, EPSILON = 0.01, 0.9, 0.999, 1e-7
MOMENTUM = 0.9


def initial_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"hidden": {"w": rng.standard_normal(SIZES[:2]).astype(np.float32) * 0.5,
                       "b": np.zeros(SIZES[1], np.float32)},
            "out": {"w": rng.standard_normal(SIZES[1:]).astype(np.float32) * 0.5,
                    "b": np.zeros(SIZES[2], np.float32)}}


def loss(params, x, y):
    h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
    log_p = jax.nn.log_softmax(h @ params["out"]["w"] + params["out"]["b"])
    return -jnp.mean(log_p[jnp.arange(len(y)), y])


grad_fn = jax.jit(jax.grad(loss))


def global_batches(steps: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((NUM_EXAMPLES, SIZES[0])).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((SIZES[0], SIZES[2])).astype(np.float32), axis=1).astype(np.int32)
    for step in range(steps):
        rows = (np.arange(BATCH) + step * BATCH) % NUM_EXAMPLES
        yield x[rows], y[rows]


def adam(params, grads, state, t):
    """TF's Adam (stratagem.optimizers.Adam's rule), in jax.numpy."""
    lr_t = LR * math.sqrt(1 - BETA_2 ** t) / (1 - BETA_1 ** t)
    m = jax.tree_util.tree_map(lambda m, g: m + (g - m) * (1 - BETA_1), state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: v + (g * g - v) * (1 - BETA_2), state["v"], grads)
    params = jax.tree_util.tree_map(lambda w, m, v: w - lr_t * m / (jnp.sqrt(v) + EPSILON), params, m, v)
    return params, {"m": m, "v": v}


def momentum(params, grads, velocity):
    velocity = jax.tree_util.tree_map(lambda v, g: MOMENTUM * v + g, velocity, grads)
    return jax.tree_util.tree_map(lambda w, v: w - LR * v, params, velocity), velocity


def flat(tree) -> dict:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def save(path: str, arrays: dict) -> None:
    np.savez(path + ".tmp.npz", **arrays)
    os.replace(path + ".tmp.npz", path)


def reference(args) -> None:
    params = jax.tree_util.tree_map(jnp.asarray, initial_params(seed=1))
    save(os.path.join(args.out, "initial.npz"), flat(params))
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = {"m": zeros, "v": zeros} if args.update == "adam" else zeros
    for t, (x, y) in enumerate(global_batches(args.steps), start=1):
        grads = grad_fn(params, x, y)
        if args.update == "adam":
            params, state = adam(params, grads, state, t)
        else:
            params, state = momentum(params, grads, state)
    save(os.path.join(args.out, "reference.npz"), flat(params))


def task(args) -> None:
    import stratagem
    import stratagem.jax

    options = {"mode": "sync"} if args.strategy == "between_graph" else {}
    strategy = stratagem.strategy(args.strategy, transport="zmq", timeout=60, **options)
    rank = strategy.cluster.replicas().index(strategy.task)
    with strategy.scope():
        tree = stratagem.jax.TreeVariables(initial_params(seed=1 if strategy.is_chief else 100 + rank))
        opt = stratagem.optimizers.Adam(learning_rate=LR, beta_1=BETA_1, beta_2=BETA_2, epsilon=EPSILON)
    velocity = jax.tree_util.tree_map(jnp.zeros_like, tree.values())
    rows = []
    for x, y in strategy.distribute_dataset(global_batches(args.steps)):
        grads = grad_fn(tree.values(), x, y)
        if args.update == "adam":
            tree.apply_gradients(opt, grads)
        else:
            params, velocity = momentum(tree.values(), tree.reduce_gradients(grads), velocity)
            for var, value in zip(tree.variables.values(), jax.tree_util.tree_leaves(params)):
                var.assign(np.asarray(value))
        rows.append(len(y))
    probe = stratagem.jax.broadcast_parameters({"probe": jnp.full(3, float(rank))}, 
                                               root=len(strategy.cluster.replicas()) - 1, strategy=strategy)
    me = strategy.task
    stem = os.path.join(args.out, f"{me.job}_{me.index}")
    save(stem + ".npz", flat(tree.values()))
    with open(stem + ".json", "w") as f:
        json.dump({"rows": rows, "broadcast": np.asarray(probe["probe"]).tolist(), "names": sorted(tree.variables)}, f)
    strategy.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", default="mirrored")
    parser.add_argument("--update", default="adam")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    (reference if args.reference else task)(args)


if __name__ == "__main__":
    main()
