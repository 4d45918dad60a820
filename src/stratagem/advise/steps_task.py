"""One task of ``stratagem advise``'s *steps* probe: a strategy's steps with no compute (started by
:mod:`stratagem.advise.probe` as a script, like the bench's training tasks; not run by hand).

    python .../stratagem/advise/steps_task.py SPEC

What the link probe times is the bare exchange (a push and its pull on a ``PSClient``, one piece;
round trips). A real step does more: ``between_graph`` reads every variable and pushes one request
per shard through ``apply_gradients`` (the variables' caches, the optimizer's bookkeeping, a sync
round's wait at the ps); ``parameter_server`` adds the coordinator's closures (sent, decoded, run,
answered); ``in_graph``'s client encodes each replica's call and merges their gradients. This task
runs the strategy named in ``SPEC`` (``strategy``, ``consistency``: its ``mode``, ``transport``, ``model``, ``steps``,
``warmup``, ``out``) on the model's real variables with the bench's step, the forward and backward
pass replaced by gradients computed once: what is left of a step is the strategy's own work.

The measuring task (the chief; the coordinator for ``parameter_server``) writes ``out``:

- ``between_graph``: each step's wall and CPU seconds (``time.process_time``: every thread) on the
  chief worker;
- ``parameter_server``: the step's wall and CPU on its worker (returned by each closure, with the
  worker's CPU clock at its end), and on the coordinator the wall and CPU of all closures, scheduled
  at once as a training loop does;
- ``in_graph``: each client step's wall and CPU.

It is a script, not a module, because ``in_graph`` and ``parameter_server`` find step functions by
name in the main script of every task (:mod:`stratagem.core.user_code`).
"""

import json
import os
import sys
import time

# Run as a file, Python puts this directory first on sys.path, where a module could shadow a
# top-level package of the same name: take it out before importing.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np  # noqa: E402

import stratagem  # noqa: E402
from stratagem.bench.models import build_model, gradient_pairs, step_values  # noqa: E402

with open(sys.argv[1]) as _f:
    SPEC = json.load(_f)
MODEL = build_model(SPEC["model"])
SEED = int(SPEC.get("seed", 0))
#: One batch and its gradients, computed once: every step applies them again (no compute).
BATCH = MODEL.batch(SEED, 0, 0, MODEL.batch_size)
_PARAMS = MODEL.init_params(SEED)
GRADS = {name: np.asarray(grad, np.asarray(_PARAMS[name]).dtype)
         for name, grad in MODEL.loss_and_grads(_PARAMS, BATCH)[1].items()}
ROWS = MODEL.sparse_rows(BATCH)


def compute() -> tuple:
    """The step's forward and backward pass, in its place between the read and the apply: wall and
    CPU seconds (left out of the step's figures). Not for its gradients (the fixed ones are applied):
    the other tasks wait meanwhile, as in training, and a transport or a ps that has waited a while
    answers more slowly than one kept busy (its pollers back off, its threads sleep), which a step
    with nothing in between would miss."""
    start, used = time.perf_counter(), time.process_time()
    if SPEC.get("compute", True):
        MODEL.loss_and_grads(_PARAMS, BATCH)
    return time.perf_counter() - start, time.process_time() - used


def hollow_step(variables: dict, opt) -> tuple:
    """Read the variables, compute, apply the fixed gradients: ``(wall, CPU, compute wall, compute
    CPU)`` seconds, the first two without the compute's."""
    start, used = time.perf_counter(), time.process_time()
    step_values(variables, ROWS)
    compute_wall, compute_cpu = compute()
    opt.apply_gradients(gradient_pairs(variables, ROWS, GRADS))
    return (time.perf_counter() - start - compute_wall, time.process_time() - used - compute_cpu,
            compute_wall, compute_cpu, time.time())


def ps_step(variables, opt):
    """A parameter_server closure: one step's figures, and this worker's CPU clock at its end."""
    *figures, ended = hollow_step(variables, opt)
    return [*figures, time.process_time(), ended]


def in_graph_step(batch):
    """An in_graph replica's part (the client merges the gradients): its compute's wall and CPU
    seconds, and its process (the client's own replica runs in the client)."""
    _, _, compute_wall, compute_cpu, _ = hollow_step(variables, opt)
    return [compute_wall, compute_cpu, os.getpid()]


def write(doc: dict, path: str | None = None) -> None:
    path = path or SPEC["out"]
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)   # the parent never reads half a file


class CpuClock:
    """This process's CPU clock read every few milliseconds in a thread, with the wall clock: a ps
    task, which serves inside ``stratagem.strategy()``, tells afterwards what the workers' steps cost
    it (its CPU between two of their timestamps)."""

    def __init__(self, every: float = 0.005):
        import threading

        self.samples: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True, name="advise-cpu-clock")
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.samples.append((time.time(), time.process_time()))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(1.0)
        return self.samples


def make_strategy():
    options = {"transport_options": {"timeout": SPEC.get("timeout", 60)}}
    if SPEC.get("consistency"):
        options["mode"] = SPEC["consistency"]
    task = _task_short()
    if not task.startswith("ps:"):
        return stratagem.strategy(SPEC["strategy"], transport=SPEC["transport"], **options)
    clock = CpuClock()
    try:
        return stratagem.strategy(SPEC["strategy"], transport=SPEC["transport"], **options)
    finally:     # (a ps task serves inside the call, and exits with SystemExit at the end)
        write({"cpu_clock": clock.stop()}, f"{SPEC['out']}.{task.replace(':', '-')}")


def _task_short() -> str:
    from stratagem.core.cluster import ClusterResolver

    return ClusterResolver.from_env().task.short


strategy = make_strategy()
with strategy.scope():
    variables = {name: stratagem.Variable(value, name=name) for name, value in sorted(_PARAMS.items())}
    opt = stratagem.optimizers.SGD(learning_rate=MODEL.learning_rate)

#: The chief's word to the other workers that its steps alone are done (no strategy uses the tag).
GO_TAG = "advise-steps-go"
TOTAL = int(SPEC.get("warmup", 3)) + int(SPEC.get("steps", 30))


def replica_steps() -> dict:
    """between_graph: this worker's steps. Async with several workers, in two phases: the chief's
    steps alone while the others wait for its word, then every worker's at once."""
    def steps() -> dict:
        times = [strategy.run(hollow_step, args=(variables, opt)) for _ in range(TOTAL)]
        return {"wall_s": [t[0] for t in times], "cpu_s": [t[1] for t in times],
                "compute_s": [t[2] for t in times], "compute_cpu_s": [t[3] for t in times],
                "ended": [t[4] for t in times]}

    others = [t for t in strategy.cluster.replicas() if t != strategy.task]
    if SPEC.get("consistency") != "async" or not others:
        return steps()
    from stratagem.core.transport import Message

    alone = None
    if strategy.is_chief:
        alone = steps()
        for task in others:
            strategy.transport.send(task, GO_TAG, Message({}), timeout=SPEC.get("timeout", 60))
    else:
        strategy.transport.recv(strategy.cluster.chief, GO_TAG, timeout=SPEC.get("timeout", 60))
    return {**steps(), "alone": alone}


def client_steps() -> dict:
    """in_graph: the client's steps over the global batch (each replica's rows), less the slowest
    replica's compute."""
    replicas = strategy.num_replicas_in_sync
    batch = tuple(np.concatenate([column] * replicas) for column in BATCH)
    wall, cpu, computed = [], [], []
    for _ in range(TOTAL):
        start, used = time.perf_counter(), time.process_time()
        out = strategy.run(in_graph_step, args=(batch,))
        took, spent = time.perf_counter() - start, time.process_time() - used
        slowest = max(value[0] for value in out.values)
        wall.append(took - slowest)
        cpu.append(spent - sum(value[1] for value in out.values if value[2] == os.getpid()))
        computed.append(slowest)
    return {"wall_s": wall, "cpu_s": cpu, "compute_s": computed, "replicas": replicas}


def coordinator_steps() -> dict:
    """parameter_server: the warm-up closures one by one, then the rest scheduled at once (as a
    training loop schedules them): their wall and CPU on the coordinator, and each step's on its worker."""
    warmup = int(SPEC.get("warmup", 3))
    for _ in range(warmup):
        strategy.schedule(ps_step, args=(variables, opt)).fetch()
    count = TOTAL - warmup
    start, used = time.perf_counter(), time.process_time()
    remotes = [strategy.schedule(ps_step, args=(variables, opt)) for _ in range(count)]
    steps = [remote.fetch() for remote in remotes]
    strategy.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - used
    return {"wall_s": [s[0] for s in steps], "cpu_s": [s[1] for s in steps], "compute_s": [s[2] for s in steps],
            "compute_cpu_s": [s[3] for s in steps], "clock_s": [s[4] for s in steps], "ended": [s[5] for s in steps],
            "workers_of": [r.worker.short for r in remotes], "closures": count,
            "coordinator_wall_s": wall, "coordinator_cpu_s": cpu}


def main() -> int:
    if SPEC["strategy"] == "parameter_server":
        try:
            doc = coordinator_steps()
        finally:
            strategy.shutdown()
    elif SPEC["strategy"] == "in_graph":
        with strategy:
            doc = client_steps()
    else:
        with strategy:
            doc = replica_steps()
        if not strategy.is_chief:     # every worker's steps, beside the chief's figures
            write(doc, f"{SPEC['out']}.{strategy.task.job}-{strategy.task.index}")
            return 0
    doc.update(strategy=SPEC["strategy"], consistency=SPEC.get("consistency"), transport=SPEC["transport"],
               warmup=int(SPEC.get("warmup", 3)), loadavg=list(os.getloadavg()))
    write(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
