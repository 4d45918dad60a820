"""The plain training script a user writes: no close(), no shutdown(), no `with strategy:`, no
`if __name__ == "__main__":` guard. It runs unchanged under every strategy; the strategy conformance
suite (:mod:`stratagem.testing.strategy_contract`) runs it as every task of a cluster. Importing this
module runs it: start it as a script (``python -m stratagem.testing.plain_training ...``).

Arguments: STRATEGY TRANSPORT [TASK ENDING]: with them, task TASK (e.g. worker:1) ends its script in
the middle of training by ENDING: ``raise`` (an uncaught exception) or ``exit`` (``sys.exit(3)``).
"""

import sys

import numpy as np

import stratagem

name, _, mode = sys.argv[1].partition(":")     # e.g. between_graph:sync
transport = sys.argv[2]
failing_task, ending = sys.argv[3:5] if len(sys.argv) > 4 else (None, None)

strategy = stratagem.strategy(name, transport=transport, **({"mode": mode} if mode else {}))
with strategy.scope():
    w = stratagem.Variable(np.zeros(4, np.float32), name="w")
    opt = stratagem.optimizers.SGD(0.1)


def step(x):
    opt.apply_gradients([(x.mean(axis=0), w)])


for i in range(6):
    if i == 3 and strategy.task.short == failing_task:
        if ending == "raise":
            raise RuntimeError(f"{failing_task} failed on purpose")
        sys.exit(3)
    strategy.run(step, args=(np.ones((4, 4), np.float32),))
print(f"trained: w = {w.value.tolist()}")
