"""One task of ``timeline_overhead.py`` (started by it through the launcher; not run by hand).

Arguments: STRATEGY MODEL STEPS WARMUP [MODE]. Trains MODEL (``stratagem.bench.models``) with plain
SGD under STRATEGY over zmq, each step one ``strategy.run`` (read the variables, compute, apply), and
prints on the chief one line ``RESULT {json}`` with every timed step's seconds (perf_counter around
``strategy.run``).

MODE ``job`` (default): whether a timeline is recorded is up to the environment (STRATAGEM_TIMELINE).
MODE ``steps``: the replicas record every other step (odd steps on, even steps off, the same on every
replica), through a recorder handed to the transport (``transport_options``) that switches between a
real recorder and ``timeline.OFF``: the two kinds of step then share the job, the load and the
network, which a comparison between jobs on a busy machine cannot promise.
"""

import json
import os
import sys
import time

import stratagem
from stratagem.bench.models import build_model
from stratagem.core import timeline


class Alternating(timeline.NullRecorder):
    """Records into ``recording`` while on, nothing while off (mode ``steps`` flips it every step): the
    hot paths look the recorder's methods up at each call, so they follow the switch."""

    def __init__(self, recording: timeline.Recorder):
        self.recording = recording
        self.use(False)

    def use(self, on: bool) -> None:
        source = self.recording if on else timeline.OFF
        for method in ("now", "add", "record", "wait", "wait_until_now", "span"):
            setattr(self, method, getattr(source, method))


strategy_name, model_name, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "job"
model = build_model(model_name)
options = {"mode": "sync"} if strategy_name == "between_graph" else {}
if mode == "steps":
    recording = timeline.Recorder(os.devnull)   # kept in memory, never written
    switch = Alternating(recording)
    options["transport_options"] = {"recorder": switch}
strategy = stratagem.strategy(strategy_name, transport="zmq", **options)   # a ps task serves here, then exits
with strategy.scope():
    variables = {name: stratagem.Variable(value, name=name) for name, value in model.init_params(0).items()}
    opt = stratagem.optimizers.SGD(model.learning_rate)
replica = strategy.cluster.replicas().index(strategy.task)


def step(batch):
    loss, grads = model.loss_and_grads({name: var.value for name, var in variables.items()}, batch)
    opt.apply_gradients([(grads[name], var) for name, var in variables.items()])
    return loss


times, on = [], []
for i in range(warmup + steps):
    batch = model.batch(0, replica, i, model.batch_size)
    if mode == "steps":
        switch.use(bool(i % 2))
    start = time.perf_counter()
    strategy.run(step, args=(batch,))
    if i >= warmup:
        times.append(time.perf_counter() - start)
        on.append(bool(i % 2) if mode == "steps" else bool(os.environ.get("STRATAGEM_TIMELINE")))
if mode == "steps":
    switch.use(False)
if strategy.is_chief:
    events = len(recording.events) if mode == "steps" else None
    print("RESULT " + json.dumps({"times": times, "on": on, "events": events}))
