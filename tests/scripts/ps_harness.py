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
