"""Every task of a TF-style job with an evaluator runs this script (tests/test_evaluator.py):

    evaluator_job.py OUT CKPT STEPS [between_graph|parameter_server]

- ``ps`` tasks serve inside ``stratagem.strategy(...)`` and exit when training ends;
- ``worker:i`` pushes the gradient ``(i + 1) * (step + 1)`` for every step (``mode="sync"``), the chief
  then writes a checkpoint into CKPT and the ps counters into OUT, and waits for the evaluator's record
  before it leaves (so that the shards still serve the evaluator's reads);
- an evaluator listed in the cluster creates the same variable, tries to train (refused), to write
  (refused) and to push gradients straight to the shard (refused by the server), then reads the
  variable from the ps task until the global step reaches STEPS;
- an evaluator outside the cluster (TF's usual form) cannot start the strategy, and reads the
  checkpoint the chief writes.

Each task writes ``OUT/<job>_<index>.json`` (the side-car: ``OUT/sidecar.json``).
"""

import json
import os
import sys
import time

import numpy as np

import stratagem
from stratagem.training import checkpoint
from stratagem.core.cluster import ClusterResolver
from stratagem.ps_service.client import PSClient
from stratagem.ps_service.messages import PushRequest
from stratagem.ps_service.protocol import RemoteError

out, ckpt, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
kind = sys.argv[4] if len(sys.argv) > 4 else "between_graph"
DEADLINE = time.monotonic() + 40


def write(name: str, record: dict) -> None:
    path = os.path.join(out, name + ".json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def refusal(call):
    try:
        call()
    except (stratagem.ConfigurationError, RemoteError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def descend(w, opt, g):
    """The step scheduled onto the workers under parameter_server (defined before stratagem.strategy(...):
    the workers, serving inside that call, find it by name)."""
    return opt.apply_gradients([(np.full(w.shape, g, w.dtype), w)])


resolved = ClusterResolver.from_env()
if resolved.is_evaluator and not resolved.in_cluster:
    refused = refusal(lambda: stratagem.strategy(kind, transport="zmq"))
    while time.monotonic() < DEADLINE:
        path = checkpoint.latest_checkpoint(ckpt)
        if path is not None and checkpoint.load(path).step >= steps:
            break
        time.sleep(0.05)
    saved = checkpoint.load(ckpt)
    write("sidecar", {"refused": refused, "step": saved.step, "w": saved.variables["w"].tolist()})
    sys.exit(0)

strategy = stratagem.strategy(kind, transport="zmq", mode="sync", timeout=30, transport_options={"timeout": 30})
me = strategy.task
with strategy.scope():
    w = stratagem.Variable(np.zeros(4, np.float32), name="w")
    opt = stratagem.optimizers.SGD(learning_rate=0.1)


record = {"task": me.short, "replicas": strategy.num_replicas_in_sync}
if strategy.is_evaluator:
    record["initial"] = w.numpy().tolist()
    record["apply"] = refusal(lambda: opt.apply_gradients([(np.ones(4, np.float32), w)]))
    record["assign"] = refusal(lambda: w.assign(np.ones(4, np.float32)))
    record["dataset"] = refusal(lambda: next(iter(strategy.distribute_dataset([np.zeros(2)]))))
    # Straight to the shard, past the strategy: the server itself refuses a push from a non-replica.
    raw = PushRequest(version=strategy.refresh())
    raw.add("w", np.ones(4, np.float32))
    record["raw_push"] = refusal(lambda: PSClient(strategy.transport, timeout=10).push_all({0: raw}))
    while strategy.refresh() < steps and time.monotonic() < DEADLINE:
        time.sleep(0.05)
    # No replica: its restore() reads the values as they are, without waiting for a restore of the chief's.
    record["restore"] = strategy.restore(ckpt)
    record.update(step=strategy.global_step, w=w.numpy().tolist())
    write(f"{me.job}_{me.index}", record)
    strategy.shutdown()
    sys.exit(0)

if kind == "parameter_server":                 # the chief coordinates; the workers run the steps
    for step in range(steps):
        strategy.schedule(descend, args=(w, opt, 1.5 * (step + 1)))
        strategy.join()
else:
    for step in range(steps):
        opt.apply_gradients([(np.full(4, (me.index + 1.0) * (step + 1), np.float32), w)])
record.update(w=w.numpy().tolist(), step=strategy.global_step)
if strategy.is_chief:
    record["stats"] = strategy.ps_stats()[0]
    record["checkpoint"] = strategy.save(ckpt)
    while not os.path.exists(os.path.join(out, "evaluator_0.json")) and time.monotonic() < DEADLINE:
        time.sleep(0.05)
write(f"{me.job}_{me.index}", record)
strategy.shutdown()
