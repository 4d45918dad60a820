"""One task of a ``stratagem bench`` training run (started by :mod:`stratagem.bench.runner` through
``stratagem launch`` or ``mpiexec``; not run by hand).

Every task of the cluster runs this file as its script, with ``STRATAGEM_BENCH_SPEC`` naming the run's
JSON spec (strategy, mode, transport, model, steps, output directory). It is a script, not a module,
because the ``in_graph`` and ``parameter_server`` strategies find step functions by name in the main
script of every task (see ``stratagem.core.user_code``), the way a user's training script works.

What each strategy's training tasks measure, per step (see :mod:`stratagem.bench.measure`):

- ``mirrored`` and ``between_graph``: every worker runs ``steps`` steps of its own batch, then
  measures the model's test accuracy, where the model has one;
- ``in_graph``: the client (the chief) runs ``steps`` steps of the global batch, split over the
  replicas; each replica times its own compute and returns it with its loss;
- ``parameter_server``: the coordinator schedules ``steps`` steps per worker; each step times itself
  on its worker and returns its figures.

A step is timed in two parts: *compute* (the model's forward and backward, ``loss_and_grads``) and the
rest (reading the variables, which pulls them from the ps tasks; applying the gradients, which
all-reduces or pushes them; waiting for the others). Bytes come from the transport's traffic counters.
The measuring tasks write ``OUT/<job>-<index>.json``; the runner reads them.
"""

import json
import os
import socket
import sys
import time

# Run as a file, Python puts this directory first on sys.path, where its modules (``models``,
# ``report``...) would shadow top-level packages of the same name: take it out before importing.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

import stratagem  # noqa: E402
from stratagem.bench.measure import section_bytes  # noqa: E402
from stratagem.bench.models import build_model, gradient_pairs, step_values  # noqa: E402

with open(os.environ["STRATAGEM_BENCH_SPEC"]) as _f:
    SPEC = json.load(_f)
MODEL = build_model(SPEC["model"])


def one_step(variables: dict, opt, batch: tuple) -> tuple:
    """Read, compute, apply: ``(loss, compute seconds, step seconds, wall start, wall end)``."""
    wall, start = time.time(), time.perf_counter()
    rows = MODEL.sparse_rows(batch)
    values = step_values(variables, rows)
    begin = time.perf_counter()
    loss, grads = MODEL.loss_and_grads(values, batch)
    computed = time.perf_counter()
    opt.apply_gradients(gradient_pairs(variables, rows, grads))
    end = time.perf_counter()
    return float(loss), computed - begin, end - start, wall, wall + (end - start)


# -- parameter_server: defined before stratagem.strategy(), so the workers find it by name ----------

def ps_step(variables, opt, iterator, strategy):
    """One step on a worker of the ``parameter_server`` strategy, with its own figures."""
    batch = next(iterator)
    before = strategy.transport.traffic.snapshot()
    loss, compute, step, t0, t1 = one_step(variables, opt, batch)
    traffic = strategy.transport.traffic.snapshot() - before
    return {"task": strategy.task.short, "loss": loss, "compute_s": compute, "step_s": step, "t0": t0,
            "t1": t1, "rows": len(batch[0]), "bytes": section_bytes("parameter_server", "step", traffic)}


def dataset_fn(context):
    """A parameter_server worker's endless batches: replica ``worker_index``'s, as everywhere else."""
    step = 0
    while True:
        yield MODEL.batch(SPEC["seed"], context.worker_index, step, MODEL.batch_size)
        step += 1


def make_strategy():
    """The run's strategy. Serving tasks (ps tasks; in_graph and parameter_server workers) serve
    inside this call and exit when training ends."""
    options = {"transport_options": {"timeout": SPEC["timeout"]}}
    if SPEC.get("mode"):
        options["mode"] = SPEC["mode"]
    if SPEC.get("compression"):
        options["compression"] = SPEC["compression"]
    options.update(SPEC.get("options") or {})
    return stratagem.strategy(SPEC["strategy"], transport=SPEC["transport"], **options)


strategy = make_strategy()
with strategy.scope():
    variables = {name: stratagem.Variable(value, name=name)
                 for name, value in sorted(MODEL.init_params(SPEC["seed"]).items())}
    opt = stratagem.optimizers.SGD(learning_rate=MODEL.learning_rate)


def in_graph_step(batch):
    """One in_graph replica's rows: its loss and compute seconds (the client applies the update)."""
    rows = MODEL.sparse_rows(batch)
    values = step_values(variables, rows)
    begin = time.perf_counter()
    loss, grads = MODEL.loss_and_grads(values, batch)
    compute = time.perf_counter() - begin
    opt.apply_gradients(gradient_pairs(variables, rows, grads))
    return float(loss), compute


# -- the measuring tasks ----------------------------------------------------------------------------

class Progress:
    """``@bench {...}`` lines on stdout, read by the runner's live display (at most a few a second)."""

    def __init__(self, total: int):
        self.total, self.last, self.started = total, 0.0, time.time()

    def __call__(self, done: int, rows: int, force: bool = False) -> None:
        now = time.time()
        if force or now - self.last >= 0.5:
            self.last = now
            rate = rows / (now - self.started) if now > self.started else 0.0
            print("@bench " + json.dumps({"step": done, "of": self.total, "samples_per_s": rate}), flush=True)


def write_record(record: dict) -> None:
    task = strategy.task
    path = os.path.join(SPEC["out"], f"{task.job}-{task.index}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)   # the runner never reads half a file


def replica_loop() -> dict:
    """mirrored and between_graph: this worker's own steps."""
    me, steps = strategy.task.index, []
    progress = Progress(SPEC["steps"]) if strategy.is_chief else None
    for step in range(SPEC["steps"]):
        batch = MODEL.batch(SPEC["seed"], me, step, MODEL.batch_size)
        before = strategy.transport.traffic.snapshot()
        loss, compute, took, t0, t1 = strategy.run(one_step, args=(variables, opt, batch))
        traffic = strategy.transport.traffic.snapshot() - before
        steps.append({"task": strategy.task.short, "loss": loss, "compute_s": compute, "step_s": took,
                      "t0": t0, "t1": t1, "rows": len(batch[0]), "cpu": time.process_time(),
                      "bytes": section_bytes(SPEC["strategy"], "step", traffic)})
        if progress:
            progress(step + 1, (step + 1) * MODEL.batch_size * len(strategy.cluster.replicas()))
    # after the last update (mirrored: every replica holds it; between_graph: read from the ps tasks)
    accuracy = MODEL.test_accuracy(step_values(variables, {}), SPEC["seed"]) if MODEL.test_accuracy else None
    return {"steps": steps, "test_accuracy": accuracy}


def in_graph_loop() -> dict:
    """in_graph: the client's global steps; each step's figures are the slowest replica's compute."""
    replicas = strategy.num_replicas_in_sync
    progress, steps = Progress(SPEC["steps"]), []
    for step in range(SPEC["steps"]):
        parts = [MODEL.batch(SPEC["seed"], r, step, MODEL.batch_size) for r in range(replicas)]
        batch = tuple(np.concatenate(columns) for columns in zip(*parts))
        before = strategy.transport.traffic.snapshot()
        wall, start = time.time(), time.perf_counter()
        out = strategy.run(in_graph_step, args=(batch,))
        took = time.perf_counter() - start
        traffic = strategy.transport.traffic.snapshot() - before
        rows = sum(out.rows)
        loss = sum(value[0] * n for value, n in zip(out.values, out.rows)) / rows
        steps.append({"task": strategy.task.short, "loss": loss, "compute_s": max(v[1] for v in out.values),
                      "step_s": took, "t0": wall, "t1": wall + took, "rows": rows,
                      "bytes": section_bytes("in_graph", "client", traffic)})
        progress(step + 1, (step + 1) * rows)
    return {"steps": steps}


def coordinator_loop() -> dict:
    """parameter_server: schedule every worker's share of steps, collect each step's figures."""
    workers = len(strategy.cluster.replicas()) - 1
    total = SPEC["steps"] * workers
    iterator = iter(strategy.create_per_worker_dataset(dataset_fn))
    before = strategy.transport.traffic.snapshot()
    progress = Progress(total)
    remotes = [strategy.schedule(ps_step, args=(variables, opt, iterator, strategy)) for _ in range(total)]
    steps = []
    for done, remote in enumerate(remotes, start=1):
        steps.append(remote.fetch())
        progress(done, done * MODEL.batch_size)
    strategy.join()
    traffic = strategy.transport.traffic.snapshot() - before
    return {"steps": steps, "extra_bytes": section_bytes("parameter_server", "coordinator", traffic)}


def training_replicas() -> int:
    """Replicas that compute gradients: in_graph counts the client's devices; the parameter_server
    coordinator computes none."""
    if SPEC["strategy"] == "in_graph":
        return strategy.num_replicas_in_sync
    return len(strategy.cluster.replicas()) - (SPEC["strategy"] == "parameter_server")


def main() -> int:
    started = time.time()
    if SPEC["strategy"] == "in_graph":
        with strategy:
            record = in_graph_loop()
    elif SPEC["strategy"] == "parameter_server":
        try:
            record = coordinator_loop()
        finally:
            strategy.shutdown()
    else:
        with strategy:
            record = replica_loop()
    record.update(task=strategy.task.short, host=socket.gethostname(), replicas=training_replicas(),
                  param_bytes=int(sum(v.size * v.dtype.itemsize for v in variables.values())),
                  started=started, finished=time.time())
    write_record(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
