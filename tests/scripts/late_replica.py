"""A plain training script for tests/test_late_replicas.py: ``late_replica.py STRATEGY [ENDING] [TIMEOUT]``.

STRATEGY: ``between_graph``, ``parameter_server`` or ``mirrored`` (elastic: ``on_failure="shrink"``).
Every task trains (or, under parameter_server, the chief schedules) 60 short steps; the chief prints
``training`` once its variables exist. ENDING: ``normal`` (default); ``raise`` (the chief raises
after 20 steps); ``die`` (the first process of worker:1 exits 3 after 5 steps, and a process started
again by ``--restart-workers`` waits until the launcher has recorded that the chief ended normally
before it starts, so it is back after the chief finished).
TIMEOUT: the strategy's ``timeout=`` (seconds). No close(), no __main__ guard: a user's script.
"""

import os
import sys
import time

import numpy as np

import stratagem

name = sys.argv[1]
ending = sys.argv[2] if len(sys.argv) > 2 else "normal"
restarted = os.environ.get("STRATAGEM_RESTARTS")
if ending == "die" and restarted:
    # A restarted worker that is slow to come back: back only once the launcher has recorded the
    # chief's normal end (at most 40 s), so it certainly starts after the chief finished.
    from stratagem.core.job_state import finished

    deadline = time.monotonic() + 40
    while not finished() and time.monotonic() < deadline:
        time.sleep(0.05)
options = {"transport_options": {"peer_timeout": 2}}
if name == "mirrored":
    options["on_failure"] = "shrink"
if len(sys.argv) > 3:
    options["timeout"] = float(sys.argv[3])
steps = {"n": 0}


def step(w, opt, strategy):
    steps["n"] += 1
    if ending == "die" and strategy.task.short == "worker:1" and not restarted and steps["n"] > 5:
        os._exit(3)
    time.sleep(0.05)
    opt.apply_gradients([(np.ones(4, np.float32), w)])


strategy = stratagem.strategy(name, **options)
with strategy.scope():
    w = stratagem.Variable(np.zeros(4, np.float32), name="w")
    opt = stratagem.optimizers.SGD(0.01)
if strategy.is_chief:
    print("training", flush=True)
if name == "parameter_server":
    for i in range(60):
        strategy.schedule(step, args=(w, opt, strategy))
    if ending == "raise":
        raise RuntimeError("the chief failed on purpose")
    strategy.join()
elif name == "mirrored":
    @strategy.elastic
    def train():
        for _ in strategy.distribute_dataset([np.zeros((6, 4), np.float32)] * 60):
            step(w, opt, strategy)

    train()
else:
    for i in range(60):
        if i == 20 and ending == "raise" and strategy.is_chief:
            raise RuntimeError("the chief failed on purpose")
        strategy.run(step, args=(w, opt, strategy))
print(f"trained: w = {w.value.tolist()}", flush=True)
