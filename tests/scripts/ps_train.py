"""The linear regression of examples/linear_regression_ps.py, instrumented for tests/test_between_graph.py.

    ps_train.py --out DIR [--mode M] [--steps N] [--lr LR] [--staleness S] [--aggregate N]
                [--ckpt DIR --save-every K] [--die-task worker:2 --die-at K] [--ps-die-after-ckpt ps:1]
                [--slow-task worker:2 --slow SECONDS] [--timeout S] [--peer-timeout S]

Every task runs it under ``stratagem launch --ps P --worker W``. Workers write ``DIR/worker_<i>.json``
(start step, local steps, final W and b, acknowledgements per shard, the staleness clocks seen);
ps tasks serve (``exit_after_serving=False``) and write ``DIR/ps_<i>.json`` with their counters. A task
that fails writes ``DIR/<job>_<i>.error.json`` (type, the task it names, message, seconds since its
last good step) and exits 3 (worker) or 4 (ps).

``--die-task T --die-at K``: task T SIGKILLs itself at its local step K, between computing its
gradients and pushing them. ``--ps-die-after-ckpt ps:1``: that ps task SIGKILLs itself as soon as the
chief's first checkpoint exists in ``--ckpt`` and every worker has made a step (``<task>.started``). SIGTERM is ignored, so that when the launcher stops the
job after a death, the survivors still report what they saw (the launcher SIGKILLs after --grace).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import numpy as np  # noqa: E402

import stratagem  # noqa: E402
from linear_regression_ps import batch, loss_and_grads  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--mode", default="async")
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--staleness", type=int)
parser.add_argument("--aggregate", type=int)
parser.add_argument("--ckpt")
parser.add_argument("--save-every", type=int, default=200)
parser.add_argument("--die-task")
parser.add_argument("--die-at", type=int)
parser.add_argument("--ps-die-after-ckpt")
parser.add_argument("--slow-task")
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--timeout", type=float, default=30.0)
parser.add_argument("--peer-timeout", type=float, default=5.0)
args = parser.parse_args()

signal.signal(signal.SIGTERM, lambda *_: None)
me = stratagem.ClusterResolver.from_env().task
stem = os.path.join(args.out, f"{me.job}_{me.index}")


def write(suffix, record):
    with open(stem + suffix, "w") as f:
        json.dump(record, f)


if args.ps_die_after_ckpt == me.short:
    def die_after_checkpoint():
        started = [os.path.join(args.out, f"{t.job}_{t.index}.started") for t in
                   stratagem.ClusterResolver.from_env().cluster.replicas()]
        while not (os.path.exists(os.path.join(args.ckpt, "latest")) and all(map(os.path.exists, started))):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die_after_checkpoint, daemon=True).start()

options = {"mode": args.mode, "checkpoint_dir": args.ckpt, "timeout": args.timeout, "exit_after_serving": False,
           "transport_options": {"timeout": args.timeout, "peer_timeout": args.peer_timeout}}
if args.staleness is not None:
    options["staleness"] = args.staleness
if args.aggregate is not None:
    options["replicas_to_aggregate"] = args.aggregate
began = time.monotonic()
try:
    strategy = stratagem.strategy("between_graph", transport="zmq", **options)
except stratagem.StratagemError as exc:  # a ps task whose job failed
    write(".error.json", {"type": type(exc).__name__, "message": str(exc),
                          "task": str(getattr(exc, "task", "")), "seconds": time.monotonic() - began})
    print(f"{me.short}: {exc}", file=sys.stderr)
    sys.exit(4)
if me.job == "ps":
    write(".json", strategy.served)
    sys.exit(0)

record = {"task": me.short, "clocks": [], "statuses": {}}
last_good = time.monotonic()
try:
    with strategy.scope():
        w = stratagem.Variable(np.random.default_rng(0).uniform(-1.0, 1.0, 1).astype(np.float32), name="W")
        b = stratagem.Variable(np.zeros(1, np.float32), name="b")
        opt = stratagem.optimizers.SGD(learning_rate=args.lr)
    record["start"] = strategy.global_step
    local_step, saved, last_good = 0, record["start"] // args.save_every, time.monotonic()
    while not strategy.should_stop():
        x, y = batch(0, me.index, local_step, 100)
        loss, grad_w, grad_b = loss_and_grads(w.value, b.value, x, y)
        if me.short == args.die_task and local_step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if me.short == args.slow_task:
            time.sleep(args.slow)
        opt.apply_gradients([(grad_w, w), (grad_b, b)])
        for status in strategy.last_push.values():
            record["statuses"][status] = record["statuses"].get(status, 0) + 1
        if strategy.last_clock is not None:
            record["clocks"].append(list(strategy.last_clock))
        local_step += 1
        last_good = time.monotonic()
        if local_step == 1:
            write(".started", {})
        if strategy.is_chief:
            step = strategy.global_step
            if args.ckpt and step // args.save_every > saved:
                saved = step // args.save_every
                strategy.save(args.ckpt)
            if step >= args.steps:
                strategy.request_stop()
    record.update(steps=local_step, global_step=strategy.global_step, W=float(w.numpy()[0]), b=float(b.numpy()[0]),
                  acks={str(k): v for k, v in strategy.acks.items()})
except stratagem.PeerLostError as exc:
    write(".error.json", {"type": type(exc).__name__, "task": str(exc.task), "message": str(exc),
                          "seconds": time.monotonic() - last_good})
    print(f"{me.short}: {exc}", file=sys.stderr)
    strategy.fail(exc)
    sys.exit(3)
strategy.shutdown()
write(".json", record)
