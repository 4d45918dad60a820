"""One replica of benchmarks/elastic_commit.py (started by it under ``stratagem launch``; not run by hand).

    _elastic_commit_worker.py OUT MODE STEPS WARMUP

MODE: ``raise`` (mirrored, default), ``shrink1`` (on_failure="shrink", commit_every=1) or ``shrink10``
(commit_every=10). Trains an MLP 784-512-512-10 (float32 numpy, plain SGD, 128 rows per replica) in
``strategy.elastic``; the time of each loop iteration (the commit that ``distribute_dataset`` makes
before a batch included) is measured with ``time.perf_counter``. The chief writes OUT (JSON): the
per-step times after the warm-up, the max over the replicas of each step, and its own commit times.
"""

import json
import sys
import time

import numpy as np

import stratagem

out, mode, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
options = {"raise": {}, "shrink1": {"on_failure": "shrink", "commit_every": 1},
           "shrink10": {"on_failure": "shrink", "commit_every": 10}}[mode]
strategy = stratagem.strategy("mirrored", transport="zmq", **options)
sizes = (784, 512, 512, 10)
rng = np.random.default_rng(0)
with strategy.scope():
    weights = [stratagem.Variable((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), name=f"w{i}")
               for i, (a, b) in enumerate(zip(sizes, sizes[1:]))]
    opt = stratagem.optimizers.SGD(learning_rate=0.01)
rows = 128 * strategy.num_replicas_in_sync
x = rng.standard_normal((rows, sizes[0])).astype(np.float32)
y = rng.integers(0, sizes[-1], rows)
batches = [(x, y)] * (warmup + steps)


def grads_of(xs, ys):
    acts = [xs]
    for w in weights[:-1]:
        acts.append(np.maximum(acts[-1] @ w.value, 0))
    logits = acts[-1] @ weights[-1].value
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(ys)), ys] -= 1
    delta, grads = p / len(ys), []
    for i in range(len(weights) - 1, -1, -1):
        grads.append(acts[i].T @ delta)
        if i:
            delta = (delta @ weights[i].value.T) * (acts[i] > 0)
    return grads[::-1]


times, commits = [], []
if strategy._elastic is not None:   # time each commit (its all-reduce and its copy) on its own too
    _commit = strategy._elastic.commit

    def timed_commit():
        began = time.perf_counter()
        _commit()
        commits.append(time.perf_counter() - began)

    strategy._elastic.commit = timed_commit


@strategy.elastic
def train():
    last = time.perf_counter()
    for xs, ys in strategy.distribute_dataset(batches):
        opt.apply_gradients(list(zip(grads_of(xs, ys), weights)))
        now = time.perf_counter()
        times.append(now - last)
        last = now


train()
slowest = strategy.reduce("max", np.array(times[warmup:]))
if strategy.is_chief:
    with open(out, "w") as f:
        json.dump({"mode": mode, "step_s": slowest.tolist(), "commit_s": commits[1:]}, f)
