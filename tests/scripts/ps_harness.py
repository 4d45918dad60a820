"""Run a parameter-server cluster as threads of one process over the ``local`` transport (tests).

``run_cluster(ps, workers, body, ...)`` starts one thread per task, each with its own strategy: the
ps tasks serve (``exit_after_serving=False``) and the others run ``body(strategy, rank)``. Returns
``(results, errors)`` keyed by the task's short name (``"worker:1"``, ``"ps:0"``: a ps task's result
is its server's counters). Every thread is joined before it returns; one that hangs fails the test.
"""

from __future__ import annotations

import threading
import time

from stratagem import ClusterSpec
from stratagem.transports.local import LocalFabric


def cluster_spec(ps: int, workers: int, chief: bool = False) -> ClusterSpec:
    jobs = {"worker": [f"local:{i}" for i in range(workers)], "ps": [f"local:{100 + i}" for i in range(ps)]}
    if chief:
        jobs["chief"] = ["local:200"]
    return ClusterSpec(jobs)


def run_cluster(ps: int, workers: int, body, *, strategy: str = "between_graph", timeout: float = 20.0,
                chief: bool = False, fabric: LocalFabric | None = None, per_task=None, **options):
    """See the module doc. ``per_task(task) -> dict`` adds options per task."""
    from stratagem.plugins.manager import plugin_manager

    cls = plugin_manager().strategy_class(strategy)
    cluster = cluster_spec(ps, workers, chief)
    fabric = fabric or LocalFabric()
    results, errors = {}, {}
    tasks = [t.short for t in cluster.tasks()]

    def target(task: str) -> None:
        try:
            extra = per_task(task) if per_task else {}
            strategy_ = cls("local", cluster=cluster, task=task, exit_after_serving=False,
                            transport_options={"fabric": fabric, "timeout": timeout}, **{**options, **extra})
            if task.startswith("ps:"):
                results[task] = strategy_.served
                return
            with strategy_:
                rank = cluster.replicas().index(strategy_.task)
                results[task] = body(strategy_, rank)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[task] = exc

    threads = {t: threading.Thread(target=target, args=(t,), daemon=True, name=f"task-{t}") for t in tasks}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + timeout * 2 + 10
    for thread in threads.values():
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t, thread in threads.items() if thread.is_alive()]
    if stuck:
        raise AssertionError(f"tasks {stuck} did not finish within {timeout * 2 + 10:g} s; errors: {errors}")
    return results, errors


def ok(results_errors):
    results, errors = results_errors
    if errors:
        task, exc = sorted(errors.items())[0]
        raise AssertionError(f"{len(errors)} task(s) failed; {task}: {type(exc).__name__}: {exc}") from exc
    return results


def push_grads(client, grads, *, versions=None, weight: float = 1.0, pull: bool = False, rows=None, skip=None,
         compression=None, all_shards: bool = True) -> dict:
    """Push ``{shard: (piece names, gradients)}`` with ``client`` (a ``PSClient``), as a test writes it:
    ``rows`` ``{shard: (names, [rows], [values])}``, ``skip`` ``{shard: [names]}``, ``compression``
    ``{shard: metadata}`` with the gradients already the payloads. Returns ``{shard: reply}``, each the
    whole answer (parts joined) as a wire message; every shard gets a push unless ``all_shards`` is off."""
    from stratagem.ps_service.messages import PushRequest

    rows, skip, compression = rows or {}, skip or {}, compression or {}
    shards = range(client.num_shards) if all_shards else sorted(set(grads) | set(rows))
    requests = {}
    for i in shards:
        request = PushRequest(weight=weight, pull=pull, version=None if versions is None else versions.get(i, 0),
                              skip=skip.get(i, ()))
        names, arrays = grads.get(i, ([], []))
        request.names, request.dense = list(names), list(arrays)   # arrays: the payloads when compressed
        for name, indices, values in zip(*rows.get(i, ([], [], []))):
            request.add_rows(name, indices, values)
        request.compression = compression.get(i)
        requests[i] = request
    return {index: message for index, message in _joined(client.push(requests))}


def _joined(answers):
    from stratagem.core.transport import Message

    parts: dict = {}
    for index, message, last in answers:
        parts.setdefault(index, []).append(message)
        if last:
            got = parts.pop(index)
            meta = {k: v for k, v in got[-1].meta.items() if k not in ("part", "parts")}
            meta["names"] = [n for m in got for n in m.meta.get("names") or []]
            yield index, Message(meta, [b for m in got for b in m.buffers], got[-1].src)
