"""The training script of the strategy conformance suite's deeper checks: linear regression by SGD with
momentum on global batches of uneven size, written as a user writes it (no ``close()``, no ``__main__``
guard). Importing this module runs it: start it as a script
(``python -m stratagem.testing.conformance_training``).

Arguments: STRATEGY TRANSPORT DATA OUT [CKPT (save|restore)]. DATA is an ``.npz`` holding the initial
``w`` and ``b`` and the global batches ``x`` and ``y`` (one row of each per batch), as
:func:`stratagem.testing.strategy_contract.write_training_data` writes them. The chief writes the
trained ``w`` and ``b`` and the optimizer's iterations to OUT (an ``.npz``). With ``CKPT save`` the
job trains the first half of the batches and saves a checkpoint into CKPT; with ``CKPT restore`` it
restores CKPT and trains the second half, the chief coming to ``restore`` late (after
:data:`CHIEF_LATE_S`): the other replicas get there first, and must not train on the values the
checkpoint replaces.
"""

import sys
import time

import numpy as np

import stratagem

name, _, mode = sys.argv[1].partition(":")     # e.g. between_graph:sync
transport, data, out = sys.argv[2:5]
ckpt, phase = sys.argv[5:7] if len(sys.argv) > 6 else (None, None)

with np.load(data) as arrays:
    start = {"w": arrays["w"], "b": arrays["b"]}
    batches = list(zip(arrays["x"], arrays["y"]))

strategy = stratagem.strategy(name, transport=transport, **({"mode": mode} if mode else {}))
with strategy.scope():
    w = stratagem.Variable(start["w"], name="w")
    b = stratagem.Variable(start["b"], name="b")
    opt = stratagem.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def step(x, y):
    err = x @ w.value + b.value - y                       # this replica's rows
    opt.apply_gradients([(2 * x.T @ err / len(x), w), (2 * err.mean(axis=0), b)])


#: How late the chief comes to ``restore``: long enough that the others are surely waiting in it.
CHIEF_LATE_S = 1.0

half = len(batches) // 2
if phase == "restore":
    if strategy.is_chief:
        time.sleep(CHIEF_LATE_S)
    strategy.restore(ckpt)
    batches = batches[half:]
elif phase == "save":
    batches = batches[:half]
for x, y in strategy.distribute_dataset(batches):
    strategy.run(step, args=(x, y))
if phase == "save":
    strategy.save(ckpt)
if strategy.is_chief:
    np.savez(out, w=w.value, b=b.value, iterations=np.int64(opt.iterations))
