"""The plain training script a user runs under `stratagem launch --timeline` (tests/test_timeline.py):
no close(), no shutdown(), no `with strategy:`, no `if __name__ == "__main__":` guard.

Arguments: STRATEGY[:MODE] [SLOW_TASK SECONDS [FAILING_TASK]]: SLOW_TASK (e.g. worker:1) sleeps
SECONDS in its step function every step; FAILING_TASK raises in the middle of training ("-": none).
"""

import sys
import time

import numpy as np

import stratagem

name, _, mode = sys.argv[1].partition(":")
slow_task, delay = (sys.argv[2], float(sys.argv[3])) if len(sys.argv) > 3 else ("-", 0.0)
failing_task = sys.argv[4] if len(sys.argv) > 4 else "-"

strategy = stratagem.strategy(name, **({"mode": mode} if mode else {}))
with strategy.scope():
    w = stratagem.Variable(np.zeros(50_000, np.float32), name="w")
    b = stratagem.Variable(np.zeros(10, np.float32), name="b")
    opt = stratagem.optimizers.SGD(0.01)


def step(x):
    if strategy.task.short == slow_task:
        time.sleep(delay)
    opt.apply_gradients([(np.full(50_000, x, np.float32), w), (np.full(10, x, np.float32), b)])


for i in range(6):
    if i == 3 and strategy.task.short == failing_task:
        raise RuntimeError(f"{failing_task} failed on purpose")
    strategy.run(step, args=(1.0,))
print(f"trained: w[0] = {float(w.value[0]):.3f}")
